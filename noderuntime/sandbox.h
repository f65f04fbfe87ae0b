// The sandbox model shared by the node's units: what a user asked for (SandboxSpec), where it is in its
// lifecycle (SandboxState), and what a driver needs to find it again after a node restart (RuntimeInfo).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace sg {

enum class SandboxState { kCreating, kRunning, kSuspending, kSuspended, kResuming, kTerminated, kFailed };

std::string_view state_name(SandboxState s);
std::optional<SandboxState> parse_state(std::string_view s);

// What a port speaks, which tells the proxy how to carry a connection to it: http1 (HTTP/1.1 behind an HTTP
// head the proxy reads first), h2c (HTTP/2 with prior knowledge as well as HTTP/1.1, so the proxy may offer
// h2 in ALPN), tcp (raw bytes: a public tcp port is forwarded as soon as the TLS handshake is done, because
// a server such as sshd speaks first; a non-public one needs an HTTP/1.1 CONNECT with a token first).
enum class PortProtocol { kHttp1, kH2c, kTcp };

std::string_view protocol_name(PortProtocol p);  // "http1", "h2c", "tcp"
std::optional<PortProtocol> parse_protocol(std::string_view s);

// How one exposed port may be reached. A public port needs no token.
struct PortPolicy {
  uint16_t port = 0;
  bool is_public = false;
  PortProtocol protocol = PortProtocol::kHttp1;
};

// Host uids/gids per sandbox user namespace: the whole 16-bit id space a distribution's packages expect.
inline constexpr uint32_t kUidRangeSize = 65536;

struct SandboxSpec {
  std::string id;    // "sb-" + 12 chars of [a-z0-9]; stable, never reused
  std::string name;  // optional, unique among live sandboxes, DNS-label rules (names.h)
  bool ephemeral = false;  // idle -> terminate instead of suspend
  std::vector<std::string> command;  // argv, non-empty
  std::map<std::string, std::string> env;
  std::string cwd = "/";
  std::vector<uint16_t> exposed_ports;  // every exposed port (drivers forward these)
  // The policy of each exposed port, in the same order; an exposed port without an entry (a spec built by
  // older code) is private http1.
  std::vector<PortPolicy> ports;
  // Every exposed port public. Never the agent port: it runs commands as root in the sandbox, so the SDK
  // route always needs the sandbox's token or the operator token.
  bool allow_unauthenticated_access = false;
  // SHA-256 (lowercase hex) of the sandbox's access token; the token itself is only ever in create's answer.
  // Empty for sandboxes created before tokens existed: only the operator token opens their private ports.
  std::string token_sha256;
  // The port sandgate-agent listens on inside the sandbox, fixed at create (Config::agent_port then) so a
  // config change never points the proxy at a port the running agent does not serve. 0 = no agent.
  uint16_t agent_port = 0;
  uint32_t timeout_secs = 300;  // idle threshold: running -> suspended (memory tier)
  // Seconds in the memory tier before hibernating to disk; 0 = never. Only drivers that can hibernate use it.
  uint32_t hibernate_after_secs = 0;
  std::string driver = "process";  // Driver::name() of the driver that runs it
  double cpus = 1.0;            // CPU quota in cores (fractional allowed)
  uint32_t memory_mb = 512;
  // Most processes (and threads) the sandbox may have at once (cgroup pids.max); 0 = unlimited (sandboxes
  // created before the limit existed).
  uint32_t pids_max = 0;
  // Bytes the sandbox may write (its overlay's upper dir lives on an ext4 file of this size, in MiB); 0 =
  // no limit (the upper dir is a plain directory of the state dir's file system).
  uint32_t disk_mb = 0;
  // The image (snapshot/image_store.h) the root filesystem comes from, fixed at create so a restart or a
  // resume runs on the same one. Empty for sandboxes created before images existed and for QEMU sandboxes
  // that boot the initramfs alone (no image asked for, node.qemu_image empty).
  std::string image;
  // Created from a snapshot (snapshot/snapshot_store.h): its id (snapshot rm is refused while this sandbox
  // lives) and its layers, bottom first, which are then the root filesystem instead of the image's.
  std::string snapshot;
  std::vector<std::string> layers;
  // A memory snapshot's files (snapshot_store.h files_dir): start() restores them instead of booting.
  std::string memory_snapshot_dir;
  // A filesystem snapshot's disk (a VM's, snapshot_store.h files_dir + kSnapshotDisk): start() boots on an
  // overlay of it instead of the image's base disk.
  std::string snapshot_disk;
  // First host uid/gid of the sandbox's user namespace (sandbox id 0 = this, 65536 ids), allocated by the
  // node at create and held until the sandbox is gone. 0 = none (created before user namespaces).
  uint32_t uid_base = 0;
  // Outbound network access (noderuntime/egress.h, docs/egress.md): none without it (only the sandbox's own
  // loopback); with it, everything but the host, the always-denied nets, the node's deny_out and `deny_out`,
  // or only `allow_out` when that is given. Entries are "A.B.C.D[/PREFIX][:PORT]", checked at create.
  bool allow_internet_access = false;
  std::vector<std::string> allow_out;
  std::vector<std::string> deny_out;
};

// The effective policy of `port`: an exposed port's own (public when the whole sandbox is), the agent port's
// (h2c, always private), or nullopt when the port is not reachable at all.
std::optional<PortPolicy> port_policy(const SandboxSpec& spec, uint16_t port);

// SSH without an sshd (docs/ssh.md): the agent of a process or QEMU sandbox serves SSH on agent_port + 1, and port 22,
// when the sandbox does not expose 22 itself, is routed there (private, raw TCP: `sandgate ssh-proxy`).
inline constexpr uint16_t kSshPort = 22;
// The agent's SSH port in this sandbox, or 0 when it has none (no agent, or a driver whose agent does not
// serve SSH yet).
uint16_t agent_ssh_port(const SandboxSpec& spec);
// The guest port of a QEMU sandbox's identity listener (qemu_driver.h: the clock, the sandbox's id, its SSH
// keys), which only the driver may reach.
inline constexpr uint16_t kQemuIdentityPort = 1021;
// Why `port` cannot be exposed in this sandbox: the agent's port, its SSH server's and a VM's identity
// listener are reached only the way the node means them to be (with the token; never as a public port).
// nullopt for any other port.
std::optional<std::string> reserved_port(const SandboxSpec& spec, int64_t port);
// The port a connection to `port` reaches inside the sandbox: the agent's SSH port for 22 when that is
// where 22 goes, else `port` itself.
uint16_t sandbox_port(const SandboxSpec& spec, uint16_t port);

// Driver-owned facts persisted with the sandbox so a restarted node can find the running instance again.
struct RuntimeInfo {
  int pid = 0;                    // the sandbox's init process, as seen from the host
  uint64_t start_time_ticks = 0;  // /proc/<pid>/stat field 22: tells a live process from a reused pid
  std::string sandbox_dir;        // per-sandbox directory under the state dir (logs, driver files)
  // Anything else the driver needs to find or restore the instance (a QMP socket path, a state file, host
  // ports forwarded to guest ports). Opaque to the node; stored as a JSON object of strings.
  std::map<std::string, std::string> driver_data;
};

// Where a suspended sandbox's memory is: kept resident (paused) or saved to disk (hibernated).
enum class SuspendTier { kNone, kMemory, kDisk };

std::string_view tier_name(SuspendTier t);  // "", "memory", "disk"
std::optional<SuspendTier> parse_tier(std::string_view s);

}  // namespace sg
