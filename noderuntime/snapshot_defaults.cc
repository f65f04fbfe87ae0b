#include "noderuntime/snapshot_defaults.h"

namespace sg {

snapshot::Snapshot snapshot_record(const SandboxSpec& spec) {
  snapshot::Snapshot record;
  record.type = "filesystem";
  record.source_id = spec.id;
  record.source_name = spec.name;
  record.driver = spec.driver;
  record.image = spec.image;
  record.command = spec.command;
  record.env = spec.env;
  record.cwd = spec.cwd;
  for (uint16_t port : spec.exposed_ports)
    if (auto policy = port_policy(spec, port))
      record.ports.push_back({port, policy->is_public, std::string(protocol_name(policy->protocol))});
  return record;
}

Status apply_snapshot_defaults(const snapshot::Snapshot& snap, CreateRequest& req) {
  if (req.image && *req.image != snap.image)
    return fail(Error::kInvalidArgument, "image: a sandbox created from a snapshot runs on the snapshot's image (" +
                                             snap.image + "), not '" + *req.image + "'");
  if (req.driver && *req.driver != snap.driver)
    return fail(Error::kInvalidArgument, "driver: snapshot " + snap.id + " is of a " + snap.driver +
                                             " sandbox, so the sandbox made from it runs on that driver");
  if (snap.type == "memory") {
    // The saved RAM and devices are of this shape; a guest cannot continue in another.
    if (req.memory_mb && *req.memory_mb != static_cast<int64_t>(snap.memory_mb))
      return fail(Error::kInvalidArgument, "memory_mb: snapshot " + snap.id + " is a memory snapshot of a " +
                                               std::to_string(snap.memory_mb) +
                                               " MiB guest, so the sandbox made from it has that much");
    if (req.cpus && *req.cpus != snap.cpus)
      return fail(Error::kInvalidArgument, "cpus: snapshot " + snap.id + " is a memory snapshot of a guest with " +
                                               std::to_string(snap.cpus) + " cpus, so the sandbox made from it has as many");
    req.memory_mb = snap.memory_mb;
    req.cpus = snap.cpus;
  }
  req.image = snap.image;
  req.driver = snap.driver;
  if (req.command.empty()) req.command = snap.command;
  for (const auto& [key, value] : snap.env) req.env.emplace(key, value);  // what the request sets wins
  if (!req.cwd) req.cwd = snap.cwd;
  if (req.exposed_ports.empty() && req.ports.empty())
    for (const snapshot::SnapshotPort& p : snap.ports) req.ports.push_back({p.port, p.is_public, p.protocol});
  return {};
}

}  // namespace sg
