#include "noderuntime/create_spec.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "noderuntime/driver.h"
#include "noderuntime/egress.h"
#include "noderuntime/names.h"
#include "noderuntime/port_exposure.h"
#include "noderuntime/snapshot_defaults.h"
#include "noderuntime/snapshot_service.h"
#include "snapshot/image_store.h"

namespace sg {
namespace {

constexpr int64_t kMinMemoryMb = 16;
constexpr int64_t kMaxMemoryMb = 1024 * 1024;
constexpr double kMaxCpus = 1024;

bool valid_env_key(std::string_view key) {
  auto alpha = [](char c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_'; };
  if (key.empty() || !alpha(key[0])) return false;
  return std::all_of(key.begin(), key.end(), [&](char c) { return alpha(c) || (c >= '0' && c <= '9'); });
}

bool has_nul(std::string_view s) { return s.find('\0') != std::string_view::npos; }

const Driver* find_driver(const CreateContext& context, std::string_view name) {
  for (const auto& d : context.drivers)
    if (d->name() == name) return d.get();
  return nullptr;
}

// A create from a snapshot: the request with the snapshot's defaults filled in (nullopt: none was named).
Result<std::optional<snapshot::Snapshot>> apply_snapshot(CreateRequest& req, const SnapshotService* snapshots) {
  if (!req.snapshot_id) return std::optional<snapshot::Snapshot>();
  if (snapshots == nullptr) return fail(Error::kUnavailable, "this node has no snapshot store");
  auto snap = snapshots->get(*req.snapshot_id);
  if (!snap) return fail(snap.error(), "snapshot_id: " + snap.message());
  if (auto s = apply_snapshot_defaults(*snap, req); !s) return s.failure();
  return std::optional<snapshot::Snapshot>(std::move(*snap));
}

}  // namespace

Result<SandboxSpec> make_sandbox_spec(CreateRequest req, const CreateContext& context) {
  const SnapshotService* snapshots = context.snapshots;
  auto snap = apply_snapshot(req, snapshots);
  if (!snap) return snap.failure();
  const Config* cfg = &context.config;
  auto invalid = [](std::string msg) { return fail(Error::kInvalidArgument, std::move(msg)); };
  SandboxSpec spec;
  if (req.name) {
    if (auto s = validate_name(*req.name); !s) return s.failure();
    spec.name = *req.name;
  }
  spec.ephemeral = req.ephemeral;
  if (req.command.empty()) return invalid("command: needs at least one element (the program to run)");
  for (size_t i = 0; i < req.command.size(); ++i) {
    if (req.command[i].empty()) return invalid("command[" + std::to_string(i) + "]: must not be empty");
    if (has_nul(req.command[i])) return invalid("command[" + std::to_string(i) + "]: must not contain NUL bytes");
  }
  spec.command = req.command;
  for (const auto& [key, value] : req.env) {
    if (!valid_env_key(key))
      return invalid("env: key '" + key + "' is not a valid variable name ([A-Za-z_][A-Za-z0-9_]*)");
    // An empty value is a legitimate setting (FOO=), but a NUL would silently truncate it.
    if (has_nul(value)) return invalid("env." + key + ": must not contain NUL bytes");
  }
  spec.env = req.env;
  if (req.cwd) {
    if (req.cwd->empty() || req.cwd->front() != '/') return invalid("cwd: must be an absolute path");
    if (has_nul(*req.cwd)) return invalid("cwd: must not contain NUL bytes");
    spec.cwd = *req.cwd;
  }
  if (req.exposed_ports.size() + req.ports.size() > kMaxExposedPorts)
    return invalid("exposed_ports + ports: at most " + std::to_string(kMaxExposedPorts) + " ports, got " +
                   std::to_string(req.exposed_ports.size() + req.ports.size()));
  spec.agent_port = cfg->agent_port;
  std::set<int64_t> seen_ports;
  auto add_port = [&](std::string_view field, int64_t port, bool is_public,
                      PortProtocol protocol) -> std::optional<std::string> {
    std::string where = std::string(field) + ": " + std::to_string(port);
    if (port < 1 || port > 65535) return where + " is not a TCP port (1-65535)";
    if (port == spec.agent_port)
      return where + " is the agent's port (agent_port), which is always reachable with the sandbox's token";
    if (!seen_ports.insert(port).second) return where + " is listed twice";
    spec.exposed_ports.push_back(static_cast<uint16_t>(port));
    spec.ports.push_back(PortPolicy{static_cast<uint16_t>(port), is_public, protocol});
    return std::nullopt;
  };
  for (int64_t port : req.exposed_ports)
    if (auto bad = add_port("exposed_ports", port, false, PortProtocol::kHttp1)) return invalid(*bad);
  for (const CreateRequest::Port& p : req.ports) {
    PortProtocol protocol = PortProtocol::kHttp1;
    if (p.protocol) {
      auto parsed = parse_protocol(*p.protocol);
      if (!parsed) return invalid("ports[].protocol: '" + *p.protocol + "' is not one of http1, h2c, tcp");
      protocol = *parsed;
    }
    if (auto bad = add_port("ports", p.port, p.is_public.value_or(false), protocol)) return invalid(*bad);
  }
  spec.allow_unauthenticated_access = req.allow_unauthenticated_access;
  int64_t timeout = req.timeout_secs.value_or(cfg->node.default_timeout_secs);
  if (timeout < 1 || timeout > static_cast<int64_t>(cfg->node.max_timeout_secs))
    return invalid("timeout_secs: must be between 1 and " + std::to_string(cfg->node.max_timeout_secs) +
                   " (node.max_timeout_secs)");
  spec.timeout_secs = static_cast<uint32_t>(timeout);
  int64_t hibernate_after = req.hibernate_after_secs.value_or(cfg->node.default_hibernate_after_secs);
  if (hibernate_after < 0 || hibernate_after > static_cast<int64_t>(cfg->node.max_timeout_secs))
    return invalid("hibernate_after_secs: must be between 0 (never) and " +
                   std::to_string(cfg->node.max_timeout_secs) + " (node.max_timeout_secs)");
  spec.hibernate_after_secs = static_cast<uint32_t>(hibernate_after);
  spec.driver = req.driver.value_or(std::string(context.drivers.front()->name()));
  // The agent's port is refused above whatever the driver; the others depend on it.
  for (uint16_t port : spec.exposed_ports)
    if (auto why = reserved_port(spec, port)) return invalid("port " + std::to_string(port) + " is " + *why);
  const Driver* driver = find_driver(context, spec.driver);
  if (driver == nullptr) {
    std::string enabled;
    for (const auto& d : context.drivers) enabled += (enabled.empty() ? "" : ", ") + std::string(d->name());
    return invalid("driver: '" + spec.driver + "' is not enabled on this node (enabled: " + enabled + ")");
  }
  double cpus = req.cpus.value_or(spec.cpus);
  if (!std::isfinite(cpus) || cpus <= 0 || cpus > kMaxCpus) return invalid("cpus: must be > 0 and <= 1024");
  spec.cpus = cpus;
  int64_t memory = req.memory_mb.value_or(spec.memory_mb);
  if (memory < kMinMemoryMb || memory > kMaxMemoryMb) return invalid("memory_mb: must be between 16 and 1048576");
  spec.memory_mb = static_cast<uint32_t>(memory);
  int64_t pids = req.pids_max.value_or(cfg->node.default_pids_max);
  if (pids < kMinPidsMax || pids > kMaxPidsMax)
    return invalid("pids_max: must be between " + std::to_string(kMinPidsMax) + " and " + std::to_string(kMaxPidsMax));
  spec.pids_max = static_cast<uint32_t>(pids);
  // Only a driver that enforces it gets the default (a VM's disk is its qcow2 overlay, sized by the image).
  const bool limits_disk = driver->capabilities().disk_limit;
  int64_t disk = req.disk_mb.value_or(limits_disk ? cfg->node.default_disk_mb : 0);
  if (disk != 0 && (disk < kMinDiskMb || disk > kMaxDiskMb))
    return invalid("disk_mb: must be 0 (no limit) or between " + std::to_string(kMinDiskMb) + " and " +
                   std::to_string(kMaxDiskMb));
  spec.disk_mb = static_cast<uint32_t>(disk);
  spec.allow_internet_access = req.allow_internet_access.value_or(cfg->node.default_allow_internet_access);
  if (auto policy = make_egress_policy(spec.allow_internet_access, req.allow_out, req.deny_out); !policy)
    return invalid(policy.message());
  // Process and QEMU sandboxes go out through the node's egress (noderuntime/sandbox_egress.h); the other
  // microVM drivers have no way out of their VM.
  if (spec.allow_internet_access && spec.driver != "process" && spec.driver != "qemu")
    return invalid("allow_internet_access: only process and qemu sandboxes can have it on this node (driver '" +
                   spec.driver + "' has no egress)");
  spec.allow_out = req.allow_out;
  spec.deny_out = req.deny_out;
  // A QEMU sandbox's default is node.qemu_image, whose empty default boots the initramfs alone: a disk boot
  // (an ext4 base made from the image) only where the operator or the request asks for one.
  const bool qemu = spec.driver == "qemu";
  const char* default_key = qemu ? "node.qemu_image" : "node.default_image";
  // A memory snapshot's guest already runs on its root: the image it booted (none for an initramfs guest).
  const bool from_memory = *snap && (*snap)->type == "memory";
  spec.image = from_memory ? (*snap)->image : req.image.value_or(qemu ? cfg->node.qemu_image : cfg->node.default_image);
  if ((spec.image.empty() && !from_memory && (req.image || !qemu)) || has_nul(spec.image))
    return invalid("image: must be a non-empty image name");
  if (context.images != nullptr && !spec.image.empty()) {
    auto image = context.images->get(spec.image);
    if (!image) {
      if (image.error() != Error::kNotFound) return image.failure();
      std::string msg = std::string(kNoImageHere) + spec.image + "' on this node";
      if (!req.image)
        msg += std::string(" (") + default_key + "); build it with `sandgate image build " + spec.image +
               " --packages python3` or import one with `sandgate image import FILE.tar " + spec.image + "`";
      return fail(Error::kNotFound, msg);
    }
    // The image's config is the default; what the request sets wins.
    for (const std::string& kv : image->config.env) {
      size_t eq = kv.find('=');
      if (eq == std::string::npos || eq == 0) continue;
      spec.env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
    }
    if (!req.cwd && !image->config.working_dir.empty() && image->config.working_dir.front() == '/')
      spec.cwd = image->config.working_dir;
  }
  if (*snap) {
    spec.snapshot = (*snap)->id;
    spec.layers = (*snap)->layers;
    if ((*snap)->type == "memory") spec.memory_snapshot_dir = snapshots->files_dir((*snap)->id);
    // A VM's filesystem snapshot is its disk (no layers): the new VM boots on an overlay of it.
    else if ((*snap)->is_vm_disk())
      spec.snapshot_disk = snapshots->files_dir((*snap)->id) + "/" + kSnapshotDisk;
  }
  return spec;
}

}  // namespace sg
