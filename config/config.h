// Typed, validated configuration shared by sandgate-node and sandgate-proxy (one TOML file for both).
// A Config is immutable once loaded; reload builds a new one and swaps the pointer whole (ConfigHolder).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/net.h"

namespace sg {

enum class KtlsMode { kAuto, kOn, kOff };
enum class ShutdownPolicy { kKeep, kTerminate };

struct CertificateConfig {
  std::string cert_file;
  std::string key_file;
};

struct ProxyConfig {
  std::vector<Endpoint> listen;     // default 127.0.0.1:8443
  uint16_t public_port = 0;         // port printed in URLs; 0 = the first listen port
  unsigned workers = 0;             // 0 = one per CPU
  std::vector<CertificateConfig> certificates;  // the first one is the default (no or unknown SNI)
  KtlsMode ktls = KtlsMode::kAuto;
  // Where the kernel cannot take a TLS 1.3 connection's records (no kTLS), they move from OpenSSL to the
  // proxy's own record layer after the handshake and the SSL is freed (proxy/tls13_record_layer.h): an idle
  // connection holds about 5 KiB instead of 18. The price is in every handshake, capturing the traffic
  // secrets (OpenSSL's keylog callback formats each as hex, made cheap by proxy/keylog_format.h), and in
  // deriving the keys once a connection makes a second request or is quiet (bench/RESULTS.md, "Thirteenth
  // session"). Off: OpenSSL throughout.
  bool tls_own_record_layer = true;
  uint32_t handshake_timeout_ms = 10'000;
  // NewSessionTicket messages after a full TLS 1.3 handshake (a resumed one brings one, whatever this says).
  // Each costs the proxy CPU (about 100 µs on the benchmark machine, bench/RESULTS.md); one lets a client
  // resume its next connection, and every resumption brings a fresh one. 0: no TLS 1.3 resumption.
  uint32_t tls13_session_tickets = 1;
  // How often the session ticket key rotates (proxy/ticket_keys.h): new tickets use the new key, and tickets
  // under the two keys before it still resume, so a ticket resumes for at least twice this after it was
  // issued (OpenSSL's ticket lifetime is 2 h) and a key is gone three periods after it was made.
  uint32_t tls_ticket_key_rotation_secs = 3600;
  // Session ticket keys shared with other proxies (proxy/ticket_keys.h): a file (relative to the config
  // file's directory), one key per line; "" = the process's own keys, rotated as above. With a file its
  // owner rotates the keys (a SIGHUP re-reads it).
  std::string tls_ticket_key_file;
  uint32_t request_head_timeout_ms = 10'000;
  uint32_t max_request_head_bytes = 16 * 1024;
  uint32_t max_connections = 10'000;
  uint32_t max_connections_per_sandbox = 512;
  uint32_t max_connections_per_client = 256;  // open connections from one client address (no port)
  uint32_t wake_timeout_ms = 30'000;
  uint32_t idle_timeout_secs = 600;      // a forwarded connection with no bytes either way is closed
  uint32_t connect_timeout_ms = 5'000;   // proxy -> sandbox TCP connect
  uint32_t activity_report_interval_ms = 1'000;
  // Each worker routes new connections to a running sandbox it reached recently without asking the node
  // (proxy/route_cache.h). Read at start; off: every connection's open goes to the node.
  bool route_cache = true;
  // While sandgate-node is down, the routes cached for running sandboxes keep serving for up to this long
  // (a node that is down suspends nothing and rotates no token); 0: only within the cache_ms the node gave.
  uint32_t routes_without_node_secs = 3600;
  // A ClientHello naming a sandbox that is not known to run asks the node to start waking it, so the resume
  // overlaps the handshake; the node decides whom it wakes for (node.prewake_window_secs). Off by default
  // until an SDK test that failed once under the sanitizers with it on is understood (docs/status.md).
  bool wake_at_client_hello = false;
  std::string access_log = "-";          // "-" = stdout, "" = off, else a file path
  // A unix socket a new proxy (`sandgate-proxy --takeover`) takes the listening sockets from, so a binary
  // upgrade or restart refuses no connection (proxy/listener_handover.h). "" = none.
  std::string handover_socket;
  // After a takeover the old process finishes its connections for at most this long, then closes the rest.
  uint32_t drain_timeout_secs = 300;
  // Plain-HTTP `GET /metrics` (Prometheus text format) listeners; none by default. Loopback only unless
  // metrics_listen_allow_remote: the counters name causes and rates an outsider should not read.
  std::vector<Endpoint> metrics_listen;
  bool metrics_listen_allow_remote = false;
  // Least privilege: once its listeners are bound, the access log opened and the certificates and operator
  // token read, a proxy started as root switches to this user for good (proxy/privileges.h). "" = keep
  // running as started. It must exist and not be root (checked at load).
  std::string user;
  // The group to switch to with it; "" = the user's primary group. Needs `user`.
  std::string group;
  // Fleet (docs/fleet.md#cross-node-routing): the mutual-TLS listener other nodes' proxies hop to, this
  // node's fleet certificate (its name is the node's) and key, and the fleet CA both ends verify against
  // (deploy/gen-fleet-ca.sh). Unset fleet_cert: no cross-node routing, the single-node path as ever.
  std::vector<Endpoint> fleet_listen;
  std::string fleet_cert;
  std::string fleet_key;
  std::string fleet_ca;
  // TESTS ONLY: a JSON file standing in for the fleet's etcd view (proxy/fleet_static_directory.h).
  std::string fleet_static_directory_file;
};

// Bounds of a sandbox's pids limit (node.default_pids_max, the create's pids_max): room for its init, agent
// and command at least; at most the kernel's PID_MAX_LIMIT.
inline constexpr int64_t kMinPidsMax = 8;
inline constexpr int64_t kMaxPidsMax = 4'194'304;
// Bounds of a process sandbox's disk limit (node.default_disk_mb, the create's disk_mb), 0 being none: an
// ext4 upper dir needs a few MiB of its own; 16 TiB is ext4's file size limit with 4 KiB blocks.
inline constexpr int64_t kMinDiskMb = 16;
inline constexpr int64_t kMaxDiskMb = 16 * 1024 * 1024;

struct NodeConfig {
  std::string state_dir = "/var/lib/sandgate";
  std::vector<Endpoint> api_listen;     // extra TCP listeners for the node API (loopback); unix socket always
  // The TCP API runs commands as root in any sandbox: an address other than loopback is refused at load
  // unless the operator says, with this, that they mean it.
  bool api_listen_allow_remote = false;
  uint32_t default_timeout_secs = 300;
  uint32_t default_hibernate_after_secs = 0;  // suspended in memory -> hibernated to disk; 0 = never
  // A ClientHello (proxy.wake_at_client_hello) wakes a private port's sandbox only for a client address that
  // opened it with a verified credential within this many seconds (noderuntime/prewake_gate.h); 0: never.
  // Public ports are woken for anyone, as their requests are.
  uint32_t prewake_window_secs = 86'400;
  // Sandboxes' processes (process driver) and VMMs (QEMU, Firecracker, Cloud Hypervisor) run under
  // SCHED_BATCH: woken by a packet, they do not preempt the proxy or the node that woke them, and get their
  // share at the next tick. Off: SCHED_OTHER.
  bool batch_scheduling = true;
  uint32_t max_sandboxes = 1000;
  // What the sandboxes a node holds may reserve in all, each its create's memory_mb and cpus in any state but
  // failed (a suspended or hibernated one may be woken at any moment): a create beyond either gets 429, and a
  // fleet places by what is left. 0: no limit.
  uint32_t max_memory_mb = 0;
  uint32_t max_cpus = 0;
  uint32_t max_timeout_secs = 7 * 24 * 3600;
  ShutdownPolicy on_shutdown = ShutdownPolicy::kKeep;
  // Group of the node_socket file (mode 0660), so a proxy that dropped root (proxy.user) can still connect.
  // "" = the node's own group. It must exist (checked at load).
  std::string socket_group;
  std::string cgroup_name = "sandgate";  // parent cgroup under each hierarchy; differs per node copy
  std::string init_path;                 // sandgate-init; empty = next to the sandgate-node binary
  uint32_t suspend_timeout_ms = 10'000;  // a freeze that does not complete by then fails the transition
  // sandgate-agent, started inside every process sandbox on Config::agent_port; empty = next to sandgate-node.
  std::string agent_path;
  // Images (snapshot/image_store.h) live in <images_dir>/images and their layers in <images_dir>/layers;
  // empty = the state dir. Several nodes may share one (the e2e tests do).
  std::string images_dir;
  // The image a sandbox's root filesystem comes from when the create names none. It must exist at create.
  std::string default_image = "default";
  // Process sandboxes run in a user namespace each: sandbox uid/gid 0-65535 map to host ids
  // uid_range_base + slot * 65536 + [0, 65536), one slot per sandbox. Far from /etc/subuid's ranges (which
  // start at 100000 and grow by 65536 per user), so no host user's ids are ever a sandbox's.
  uint32_t uid_range_base = 0x10000000;
  // pids.max of a sandbox whose create sets no pids_max: processes and threads it may have at once.
  uint32_t default_pids_max = 1024;
  uint32_t default_disk_mb = 0;  // 0: no limit unless the create sets disk_mb
  uint32_t store_free_space_reserve_mb = 1024;  // imports and builds stop before the layer store's disk gets this full
  // Layers a checkpoint chain may hold above its image's before the next checkpoint flattens them into one
  // (snapshot/checkpointer.h kMaxLayersAboveImage; docs/snapshots.md#flattening): fewer means shallower
  // overlays, more means fewer flattenings (each writes those layers' bytes once more).
  uint32_t checkpoint_flatten_layers = 32;
  // A process sandbox's output.log on the host: past this many bytes it becomes output.log.1 (replacing the
  // one before) and starts again empty, so one sandbox's output takes at most twice this on disk.
  uint32_t log_max_bytes = 8 * 1024 * 1024;
  // Egress (noderuntime/egress.h, docs/egress.md): what a create without "allow_internet_access" gets, the
  // bridge and subnet sandboxes with internet access are attached to, and "CIDR[:PORT]" entries every such
  // sandbox is denied on top of its own deny_out (link-local, the metadata range, always is).
  bool default_allow_internet_access = false;
  std::string egress_bridge = "sgbr0";
  std::string egress_subnet = "10.200.0.0/16";
  std::vector<std::string> deny_out;
  // QEMU driver (`--driver qemu`). The guest kernel and initramfs come from deploy/build-guest-image.sh.
  std::string qemu_binary = "qemu-system-x86_64";
  std::string qemu_accel = "auto";      // auto = tcg (no KVM probe: a nested /dev/kvm may not run guests) | kvm | tcg
  std::string guest_kernel;             // empty = <state_dir>/guest/vmlinuz
  std::string guest_initrd;             // empty = <state_dir>/guest/initrd.img
  // The QEMU driver builds (and refreshes) the guest image with deploy/build-guest-image.sh on first use
  // (noderuntime/guest_image.h); the builder's path, empty = found next to sandgate-node.
  bool guest_image_autobuild = true;
  std::string guest_image_builder;
  uint32_t qemu_boot_timeout_ms = 30'000;  // one boot attempt; a stalled boot is killed and retried
  uint32_t qemu_boot_attempts = 3;
  // The default image of QEMU sandboxes (a create's `image` wins): its disk is the guest's root
  // (noderuntime/guest_disk.h); empty = the initramfs alone, unless the create names an image.
  std::string qemu_image;
  // Firecracker / Cloud Hypervisor drivers: enabled when the binary path is set.
  std::string firecracker_binary;
  std::string cloud_hypervisor_binary;

  // guest_kernel / guest_initrd with their defaults applied.
  std::string guest_kernel_file() const;
  std::string guest_initrd_file() const;
  // images_dir with its default applied.
  std::string images_root() const;
};

// [fleet]: this node is one of many that share sandbox names and placement through etcd (docs/fleet.md).
// Absent: the single-node default, which talks to no etcd at all.
struct FleetConfig {
  bool enabled = false;                    // true once a [fleet] table is present
  std::vector<std::string> etcd_endpoints; // http(s)://IP:PORT of each etcd member (numeric addresses)
  // For https:// members: the CA that signed their certificates ("" = the system's trust store), this
  // daemon's client certificate and key (etcd --client-cert-auth; both or neither), and the name their
  // certificates carry ("" = each member's IP address).
  std::string etcd_cacert;
  std::string etcd_cert;
  std::string etcd_key;
  std::string etcd_server_name;
  std::string node_name;                   // unique in the fleet: [a-z0-9-], 1-63 characters
  std::string advertise_api;               // how other nodes and the CLI reach this node's API (https://host:port)
  std::string advertise_ingress;           // host:port of this node's fleet ingress listener
  uint32_t lease_ttl_secs = 10;            // the node key's lease; renewed every third of it
  uint32_t capacity_sandboxes = 0;         // 0: node.max_sandboxes
  uint32_t etcd_timeout_ms = 2000;         // per etcd member tried, per request
  // Placement sends creates to other nodes' advertise_api; an https one is verified against this CA file
  // ("" = the system's trust store).
  std::string api_cacert;
};

struct Config {
  std::string source;            // file the snapshot came from ("<defaults>" for the embedded one)
  std::string domain = "sandbox.localhost";
  Endpoint node_socket;          // node API unix socket: proxy and CLI talk to the node through it
  std::string log_level = "info";
  uint16_t agent_port = 9501;    // the in-sandbox agent's port: what https://<name>.<domain> reaches
  // A file holding the operator token that api.<domain> (and the node's TCP API) require as a Bearer token.
  // Empty: api.<domain> refuses every request, and node.api_listen is a config error.
  std::string operator_token_file;
  ProxyConfig proxy;
  NodeConfig node;
  FleetConfig fleet;

  uint16_t url_port() const;
  // https://<port>-<name>.<domain>[:port]/
  std::string port_url(uint16_t port, std::string_view name) const;
};

// 127.0.0.0/8 or ::1: what node.api_listen may use without api_listen_allow_remote, and where the node API
// also answers to "localhost:PORT".
bool is_loopback(const Endpoint& ep);

// Parses and validates. Errors name the file, line and key: "conf.toml:12: proxy.workers: must be <= 256".
Result<std::shared_ptr<const Config>> load_config_file(const std::string& path);
Result<std::shared_ptr<const Config>> load_config_string(std::string_view text, std::string_view source_name,
                                                         const std::string& base_dir = ".");

// The currently active snapshot. Readers take a shared_ptr at the start of a unit of work (a connection,
// a request) and keep using it even if a reload swaps in another one meanwhile.
class ConfigHolder {
 public:
  explicit ConfigHolder(std::shared_ptr<const Config> initial) : current_(std::move(initial)) {}
  std::shared_ptr<const Config> get() const { return current_.load(std::memory_order_acquire); }
  void swap(std::shared_ptr<const Config> next) { current_.store(std::move(next), std::memory_order_release); }

 private:
  std::atomic<std::shared_ptr<const Config>> current_;
};

}  // namespace sg
