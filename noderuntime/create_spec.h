// A create request, and the sandbox spec it becomes: every field checked against its limits and the node's
// config, defaults filled in from the config, the image and (for a create from a snapshot) the snapshot. A
// pure function of its inputs apart from reading the image and snapshot records: nothing is reserved or
// started here (Node::create does that once the spec stands).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "config/config.h"
#include "noderuntime/sandbox.h"

namespace sg {

class Driver;
class SnapshotService;
namespace snapshot {
class ImageStore;
}

// A create request as the API received it: fields the client left out are nullopt/empty, numbers keep
// their JSON width so Node::create can report out-of-range values instead of silently truncating them.
struct CreateRequest {
  std::optional<std::string> name;
  std::vector<std::string> command;
  std::map<std::string, std::string> env;
  std::optional<std::string> cwd;
  std::vector<int64_t> exposed_ports;  // private http1 ports
  struct Port {
    int64_t port = 0;
    std::optional<bool> is_public;        // default false
    std::optional<std::string> protocol;  // default "http1"
  };
  std::vector<Port> ports;  // ports with an explicit policy; a port may appear here or in exposed_ports, not both
  bool allow_unauthenticated_access = false;
  std::optional<int64_t> timeout_secs;
  std::optional<int64_t> hibernate_after_secs;
  std::optional<std::string> driver;
  std::optional<double> cpus;
  std::optional<int64_t> memory_mb;
  bool ephemeral = false;
  std::optional<std::string> image;  // default: node.default_image
  std::optional<int64_t> pids_max;   // default: node.default_pids_max
  std::optional<int64_t> disk_mb;    // default: 0, no limit
  std::optional<bool> allow_internet_access;  // default: node.default_allow_internet_access
  std::vector<std::string> allow_out;         // "CIDR[:PORT]"; need internet access
  std::vector<std::string> deny_out;
  // Create from a snapshot (docs/snapshots.md): its layers are the root filesystem, and its command, env,
  // cwd and ports are the defaults (command may then be left out).
  std::optional<std::string> snapshot_id;
};

// The start of the message of a create that fails because this node has no image of the name asked for
// (the API marks that answer for fleet placement).
inline constexpr std::string_view kNoImageHere = "image: no image '";


// Ports one sandbox may expose: enough for any real service, small enough that answers and lookups stay tiny.
inline constexpr size_t kMaxExposedPorts = 64;

// What a create is checked against. `images` and `snapshots` may be null (unit tests of the state machine:
// the image name is recorded as given; a snapshot_id is then kUnavailable).
struct CreateContext {
  const Config& config;
  const std::vector<std::unique_ptr<Driver>>& drivers;  // the first is the default
  const snapshot::ImageStore* images = nullptr;
  const SnapshotService* snapshots = nullptr;
};

// The spec of a sandbox `request` asks for, without id, token or uid range (the node assigns them), or
// kInvalidArgument naming the field; kNotFound for a missing image (its message starts with kNoImageHere)
// or snapshot.
Result<SandboxSpec> make_sandbox_spec(CreateRequest request, const CreateContext& context);

}  // namespace sg
