#include "config/config.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/un.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <optional>
#include <set>
#include <sstream>

// Config loading reports every error as a value; toml++ must not throw.
#define TOML_EXCEPTIONS 0
#define TOML_HEADER_ONLY 1
// toml++ 3.3.0 states some of its parser's expectations about the input as assertions: a table header whose
// key starts with a character no key starts with ("[*a]") fails one in parse_key (found by
// tests/fuzz/config_fuzz). Without NDEBUG that aborts the process; with NDEBUG it becomes
// TOML_ASSUME, which under clang is __builtin_assume, i.e. undefined behaviour. Only where TOML_ASSERT is a
// no-op and TOML_ASSUME is not used (GCC's release build) does the parser go on to its own error for the
// input ("expected bare key starting character"). So every build gets exactly that: TOML_ASSERT is defined
// as a no-op and NDEBUG is hidden while the header is read, so TOML_ASSERT_ASSUME expands to it.
#pragma push_macro("NDEBUG")
#undef NDEBUG
#define TOML_ASSERT(expr) static_cast<void>(0)
#include <toml++/toml.h>
#pragma pop_macro("NDEBUG")
// assert() follows NDEBUG again as from here (<cassert> is meant to be included again).
#include <cassert>

#include "common/accounts.h"
#include "common/api_client.h"
#include "common/egress_rule.h"
#include "common/etcd_client.h"

namespace sg {
namespace {

// Walks one TOML table, converting known keys and remembering which were seen so the rest can be reported
// as unknown. Errors accumulate so a user sees every mistake in one run, each with file:line and key.
class TableReader {
 public:
  TableReader(const toml::table& table, std::string prefix, std::string_view source,
              std::vector<std::string>* errors)
      : table_(table), prefix_(std::move(prefix)), source_(source), errors_(errors) {}

  ~TableReader() {
    for (auto&& [key, node] : table_) {
      if (!seen_.count(std::string(key.str()))) error(node, full(key.str()), "unknown key");
    }
  }

  const toml::node* find(std::string_view key) {
    seen_.insert(std::string(key));
    return table_.get(key);
  }

  void string(std::string_view key, std::string* out) {
    const toml::node* n = find(key);
    if (!n) return;
    if (auto s = n->value<std::string>()) {
      *out = *s;
    } else {
      error(*n, full(key), "must be a string");
    }
  }

  void boolean(std::string_view key, bool* out) {
    const toml::node* n = find(key);
    if (!n) return;
    if (auto b = n->value_exact<bool>()) {
      *out = *b;
    } else {
      error(*n, full(key), "must be true or false");
    }
  }

  template <typename T>
  void integer(std::string_view key, T* out, int64_t min, int64_t max) {
    const toml::node* n = find(key);
    if (!n) return;
    auto v = n->is_integer() ? n->value<int64_t>() : std::nullopt;
    if (!v) return error(*n, full(key), "must be an integer");
    if (*v < min || *v > max)
      return error(*n, full(key), "must be between " + std::to_string(min) + " and " + std::to_string(max));
    *out = static_cast<T>(*v);
  }

  // A string or an array of strings, each with its node (for errors); nullopt when absent or mistyped (the
  // error is recorded).
  std::optional<std::vector<std::pair<const toml::node*, std::string>>> string_items(std::string_view key) {
    const toml::node* n = find(key);
    if (!n) return std::nullopt;
    std::vector<std::pair<const toml::node*, std::string>> items;
    if (auto s = n->value<std::string>()) {
      items.emplace_back(n, *s);
      return items;
    }
    const toml::array* arr = n->as_array();
    if (!arr) {
      error(*n, full(key), "must be a string or an array of strings");
      return std::nullopt;
    }
    for (const toml::node& item : *arr) {
      auto s2 = item.value<std::string>();
      if (!s2) {
        error(item, full(key), "must be a string or an array of strings");
        return std::nullopt;
      }
      items.emplace_back(&item, *s2);
    }
    return items;
  }

  // A string or an array of strings, each parsed as an endpoint.
  void endpoints(std::string_view key, std::vector<Endpoint>* out, bool allow_unix) {
    auto items = string_items(key);
    if (!items) return;
    out->clear();
    for (auto& [node, text] : *items) {
      auto ep = parse_endpoint(text);
      if (!ep) {
        error(*node, full(key), ep.message());
      } else if (!allow_unix && ep->kind == Endpoint::Kind::kUnix) {
        error(*node, full(key), "must be a TCP address (host:port)");
      } else {
        out->push_back(*ep);
      }
    }
  }

  // A string or an array of strings, each checked by `check` (its failure message is the error).
  void strings(std::string_view key, std::vector<std::string>* out,
               const std::function<Status(const std::string&)>& check) {
    auto items = string_items(key);
    if (!items) return;
    out->clear();
    for (auto& [node, text] : *items) {
      if (Status st = check(text); !st) error(*node, full(key), st.message());
      else out->push_back(text);
    }
  }

  void error(const toml::node& n, const std::string& key, const std::string& msg) {
    errors_->push_back(std::string(source_) + ":" + std::to_string(n.source().begin.line) + ": " + key + ": " + msg);
  }
  std::string full(std::string_view key) const { return prefix_.empty() ? std::string(key) : prefix_ + "." + std::string(key); }

 private:
  const toml::table& table_;
  std::string prefix_;
  std::string_view source_;
  std::vector<std::string>* errors_;
  std::set<std::string> seen_;
};

// proxy.user, proxy.group and node.socket_group must exist on the machine that loads the config, so a typo
// is a config error at load, not a failure after the proxy has bound its listeners.
void check_user(TableReader& r, const toml::table& t, std::string_view key, const std::string& name) {
  auto user = find_user(name);
  if (!user) return r.error(*t.get(key), r.full(key), user.message());
  if (!*user)
    return r.error(*t.get(key), r.full(key),
                   "no user named \"" + name + "\" (create it, e.g. useradd --system --no-create-home --shell "
                   "/usr/sbin/nologin " + name + ", or leave the key empty to keep running as started)");
  // Switching to root would drop nothing while the config claims least privilege.
  if ((*user)->uid == 0)
    r.error(*t.get(key), r.full(key), "\"" + name + "\" is root (uid 0); name an unprivileged user, or leave it empty");
}

// `unprivileged`: gid 0 is refused too (proxy.group: root's group would give back access to root's files).
void check_group(TableReader& r, const toml::table& t, std::string_view key, const std::string& name,
                 bool unprivileged) {
  auto id = find_group(name);
  if (!id) return r.error(*t.get(key), r.full(key), id.message());
  if (!*id) return r.error(*t.get(key), r.full(key), "no group named \"" + name + "\" (create it with groupadd)");
  if (unprivileged && **id == 0)
    r.error(*t.get(key), r.full(key), "\"" + name + "\" is the root group (gid 0); name an unprivileged group");
}

std::string resolve_path(const std::string& base_dir, const std::string& p) {
  if (p.empty() || p[0] == '/' || p == "-") return p;
  return base_dir + "/" + p;
}

void read_proxy(const toml::table& t, std::string_view source, const std::string& base_dir,
                std::vector<std::string>* errors, ProxyConfig* out) {
  TableReader r(t, "proxy", source, errors);
  r.endpoints("listen", &out->listen, false);
  r.endpoints("metrics_listen", &out->metrics_listen, false);
  r.boolean("metrics_listen_allow_remote", &out->metrics_listen_allow_remote);
  if (!out->metrics_listen_allow_remote) {
    for (const Endpoint& ep : out->metrics_listen)
      if (ep.kind == Endpoint::Kind::kTcp && !is_loopback(ep))
        r.error(*t.get("metrics_listen"), "proxy.metrics_listen",
                ep.to_string() + " is not a loopback address; serving the metrics beyond this host needs "
                                 "proxy.metrics_listen_allow_remote = true");
  }
  r.integer("public_port", &out->public_port, 0, 65535);
  r.integer("workers", &out->workers, 0, 256);
  std::string ktls = "auto";
  r.string("ktls", &ktls);
  if (ktls == "auto") out->ktls = KtlsMode::kAuto;
  else if (ktls == "on") out->ktls = KtlsMode::kOn;
  else if (ktls == "off") out->ktls = KtlsMode::kOff;
  else r.error(*t.get("ktls"), "proxy.ktls", "must be one of auto, on, off");
  r.integer("handshake_timeout_ms", &out->handshake_timeout_ms, 100, 600'000);
  r.integer("tls13_session_tickets", &out->tls13_session_tickets, 0, 8);
  r.integer("tls_ticket_key_rotation_secs", &out->tls_ticket_key_rotation_secs, 60, 7 * 86'400);
  r.string("tls_ticket_key_file", &out->tls_ticket_key_file);
  r.integer("request_head_timeout_ms", &out->request_head_timeout_ms, 100, 600'000);
  r.integer("max_request_head_bytes", &out->max_request_head_bytes, 1024, 1024 * 1024);
  r.integer("max_connections", &out->max_connections, 1, 10'000'000);
  r.integer("max_connections_per_sandbox", &out->max_connections_per_sandbox, 1, 10'000'000);
  r.integer("max_connections_per_client", &out->max_connections_per_client, 1, 10'000'000);
  r.integer("wake_timeout_ms", &out->wake_timeout_ms, 100, 600'000);
  r.integer("idle_timeout_secs", &out->idle_timeout_secs, 1, 7 * 24 * 3600);
  r.integer("connect_timeout_ms", &out->connect_timeout_ms, 10, 600'000);
  r.integer("activity_report_interval_ms", &out->activity_report_interval_ms, 50, 1'000);
  r.boolean("route_cache", &out->route_cache);
  r.integer("routes_without_node_secs", &out->routes_without_node_secs, 0, 7 * 24 * 3600);
  r.boolean("tls_own_record_layer", &out->tls_own_record_layer);
  r.boolean("wake_at_client_hello", &out->wake_at_client_hello);
  r.string("access_log", &out->access_log);
  out->access_log = resolve_path(base_dir, out->access_log);
  r.string("handover_socket", &out->handover_socket);
  out->handover_socket = resolve_path(base_dir, out->handover_socket);
  out->tls_ticket_key_file = resolve_path(base_dir, out->tls_ticket_key_file);
  if (out->handover_socket.size() >= sizeof(sockaddr_un{}.sun_path))
    r.error(*t.get("handover_socket"), "proxy.handover_socket",
            "longer than a unix socket path can be (" + std::to_string(sizeof(sockaddr_un{}.sun_path) - 1) + " bytes)");
  r.integer("drain_timeout_secs", &out->drain_timeout_secs, 1, 24 * 3600);
  r.string("user", &out->user);
  r.string("group", &out->group);
  if (!out->user.empty()) check_user(r, t, "user", out->user);
  if (!out->group.empty()) {
    if (out->user.empty()) r.error(*t.get("group"), "proxy.group", "needs proxy.user (the user to switch to)");
    else check_group(r, t, "group", out->group, /*unprivileged=*/true);
  }
  r.endpoints("fleet_listen", &out->fleet_listen, false);
  for (auto [key, field] : {std::pair{"fleet_cert", &out->fleet_cert}, std::pair{"fleet_key", &out->fleet_key},
                            std::pair{"fleet_ca", &out->fleet_ca},
                            std::pair{"fleet_static_directory_file", &out->fleet_static_directory_file}}) {
    r.string(key, field);
    *field = resolve_path(base_dir, *field);
  }
  const bool fleet_tls = !out->fleet_cert.empty() && !out->fleet_key.empty() && !out->fleet_ca.empty();
  const bool fleet_any = !out->fleet_cert.empty() || !out->fleet_key.empty() || !out->fleet_ca.empty();
  if (fleet_any && !fleet_tls)
    r.error(t, "proxy.fleet_cert", "proxy.fleet_cert, proxy.fleet_key and proxy.fleet_ca go together");
  if ((!out->fleet_listen.empty() || !out->fleet_static_directory_file.empty()) && !fleet_tls)
    r.error(*t.get(!out->fleet_listen.empty() ? "fleet_listen" : "fleet_static_directory_file"),
            !out->fleet_listen.empty() ? "proxy.fleet_listen" : "proxy.fleet_static_directory_file",
            "needs proxy.fleet_cert, proxy.fleet_key and proxy.fleet_ca (the fleet's mutual TLS)");
  if (const toml::node* certs = r.find("certificates")) {
    const toml::array* arr = certs->as_array();
    if (!arr || !arr->is_array_of_tables()) {
      r.error(*certs, "proxy.certificates", "must be an array of tables ([[proxy.certificates]])");
    } else {
      for (const toml::node& item : *arr) {
        CertificateConfig c;
        TableReader cr(*item.as_table(), "proxy.certificates", source, errors);
        cr.string("cert", &c.cert_file);
        cr.string("key", &c.key_file);
        if (c.cert_file.empty() || c.key_file.empty()) {
          cr.error(item, "proxy.certificates", "needs both cert and key");
          continue;
        }
        c.cert_file = resolve_path(base_dir, c.cert_file);
        c.key_file = resolve_path(base_dir, c.key_file);
        out->certificates.push_back(std::move(c));
      }
    }
  }
}

void read_fleet(const toml::table& t, std::string_view source, const std::string& base_dir,
                std::vector<std::string>* errors, FleetConfig* out) {
  TableReader r(t, "fleet", source, errors);
  out->enabled = true;
  const toml::node& here = t;
  auto at = [&](std::string_view key) -> const toml::node& { return t.get(key) ? *t.get(key) : here; };
  r.strings("etcd_endpoints", &out->etcd_endpoints, [](const std::string& text) -> Status {
    auto ep = etcd::parse_member(text);
    if (!ep) return ep.failure();
    return {};
  });
  if (out->etcd_endpoints.empty()) r.error(at("etcd_endpoints"), "fleet.etcd_endpoints", "needs at least one etcd member");
  r.string("node_name", &out->node_name);
  bool name_ok = !out->node_name.empty() && out->node_name.size() <= 63 && out->node_name.front() != '-' &&
                 out->node_name.back() != '-';
  for (char c : out->node_name) name_ok = name_ok && ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-');
  if (!name_ok) r.error(at("node_name"), "fleet.node_name", "must be 1-63 characters of [a-z0-9-], not starting or ending with '-'");
  r.string("advertise_api", &out->advertise_api);
  r.string("advertise_ingress", &out->advertise_ingress);
  for (auto [key, value] : {std::pair{"advertise_api", &out->advertise_api}, std::pair{"advertise_ingress", &out->advertise_ingress}}) {
    bool ok = value->size() <= 256;
    for (char c : *value) ok = ok && c > ' ' && c < 0x7f && c != '"' && c != '\\';
    if (!ok) r.error(at(key), std::string("fleet.") + key, "must be at most 256 printable characters without spaces or quotes");
  }
  r.integer("lease_ttl_secs", &out->lease_ttl_secs, 2, 300);
  r.integer("capacity_sandboxes", &out->capacity_sandboxes, 0, 1'000'000);
  r.integer("etcd_timeout_ms", &out->etcd_timeout_ms, 100, 60'000);
  r.string("api_cacert", &out->api_cacert);
  out->api_cacert = resolve_path(base_dir, out->api_cacert);
  for (auto [key, value] : {std::pair{"etcd_cacert", &out->etcd_cacert}, std::pair{"etcd_cert", &out->etcd_cert},
                            std::pair{"etcd_key", &out->etcd_key}}) {
    r.string(key, value);
    *value = resolve_path(base_dir, *value);
  }
  r.string("etcd_server_name", &out->etcd_server_name);
  const bool any_https = std::any_of(out->etcd_endpoints.begin(), out->etcd_endpoints.end(), [](const std::string& m) {
    auto parsed = etcd::parse_member(m);
    return parsed && parsed->tls;
  });
  const etcd::TlsFiles tls{out->etcd_cacert, out->etcd_cert, out->etcd_key, out->etcd_server_name};
  // TLS settings with only http:// members would silently talk in clear: refused.
  if (tls.any() && !any_https)
    r.error(at("etcd_endpoints"), "fleet.etcd_endpoints",
            "etcd_cacert, etcd_cert, etcd_key or etcd_server_name is set, but no member is https://");
  if (out->etcd_cert.empty() != out->etcd_key.empty()) {
    r.error(at(out->etcd_cert.empty() ? "etcd_key" : "etcd_cert"), "fleet.etcd_cert",
            "etcd_cert and etcd_key go together");
  } else if (any_https) {
    // As nginx -t does with its certificates: files that do not load are a configuration error, not a
    // fleet that cannot reach etcd later. The CA alone first, so the error names the key that is wrong.
    etcd::TlsFiles ca_only{out->etcd_cacert, "", "", ""};
    if (auto setup = etcd::TlsSetup::create(ca_only, 1); !setup) {
      r.error(at("etcd_cacert"), "fleet.etcd_cacert", setup.message());
    } else if (auto full = etcd::TlsSetup::create(tls, 1); !full) {
      const bool key = full.message().find(" key ") != std::string::npos;
      r.error(at(key ? "etcd_key" : "etcd_cert"), key ? "fleet.etcd_key" : "fleet.etcd_cert", full.message());
    }
  }
  // Other nodes send placed creates there, and the CLI talks to the node there: refused now, not then.
  if (!out->advertise_api.empty()) {
    if (auto a = parse_api_address(out->advertise_api); !a) r.error(at("advertise_api"), "fleet.advertise_api", a.message());
  }
}

void read_node(const toml::table& t, std::string_view source, const std::string& base_dir,
               std::vector<std::string>* errors, NodeConfig* out) {
  TableReader r(t, "node", source, errors);
  r.string("state_dir", &out->state_dir);
  out->state_dir = resolve_path(base_dir, out->state_dir);
  r.endpoints("api_listen", &out->api_listen, false);
  r.boolean("api_listen_allow_remote", &out->api_listen_allow_remote);
  if (!out->api_listen_allow_remote) {
    for (const Endpoint& ep : out->api_listen) {
      if (!is_loopback(ep))
        r.error(*t.get("api_listen"), "node.api_listen",
                ep.to_string() + " is not a loopback address; whoever reaches the node API can run commands as "
                                 "root in every sandbox, so serving it beyond this host needs "
                                 "node.api_listen_allow_remote = true");
    }
  }
  r.integer("default_timeout_secs", &out->default_timeout_secs, 1, 7 * 24 * 3600);
  r.integer("max_timeout_secs", &out->max_timeout_secs, 1, 365 * 24 * 3600);
  r.integer("max_sandboxes", &out->max_sandboxes, 1, 1'000'000);
  r.integer("max_memory_mb", &out->max_memory_mb, 0, 1LL << 30);
  r.integer("max_cpus", &out->max_cpus, 0, 1 << 20);
  r.integer("suspend_timeout_ms", &out->suspend_timeout_ms, 10, 600'000);
  std::string policy = "keep";
  r.string("on_shutdown", &policy);
  if (policy == "keep") out->on_shutdown = ShutdownPolicy::kKeep;
  else if (policy == "terminate") out->on_shutdown = ShutdownPolicy::kTerminate;
  else r.error(*t.get("on_shutdown"), "node.on_shutdown", "must be keep or terminate");
  r.string("socket_group", &out->socket_group);
  // Root's own group is allowed: it is what the socket has when the key is left out.
  if (!out->socket_group.empty()) check_group(r, t, "socket_group", out->socket_group, /*unprivileged=*/false);
  r.string("cgroup_name", &out->cgroup_name);
  bool cgroup_ok = !out->cgroup_name.empty() && out->cgroup_name.size() <= 64;
  for (char c : out->cgroup_name)
    cgroup_ok = cgroup_ok && (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.');
  if (!cgroup_ok || out->cgroup_name[0] == '.')
    r.error(t.get("cgroup_name") ? *t.get("cgroup_name") : static_cast<const toml::node&>(t), "node.cgroup_name",
            "must be 1-64 characters of [A-Za-z0-9._-] not starting with a dot");
  r.string("init_path", &out->init_path);
  out->init_path = resolve_path(base_dir, out->init_path);
  r.integer("default_hibernate_after_secs", &out->default_hibernate_after_secs, 0, 365 * 24 * 3600);
  r.integer("prewake_window_secs", &out->prewake_window_secs, 0, 30 * 24 * 3600);
  r.boolean("batch_scheduling", &out->batch_scheduling);
  r.string("agent_path", &out->agent_path);
  out->agent_path = resolve_path(base_dir, out->agent_path);
  r.string("images_dir", &out->images_dir);
  out->images_dir = resolve_path(base_dir, out->images_dir);
  r.string("default_image", &out->default_image);
  // 2^32 host ids: the last slot must end below 2^32 - 1 (the kernel's invalid id), with room for a few
  // thousand sandboxes above the base.
  r.integer("uid_range_base", &out->uid_range_base, 1u << 20, 0xC0000000u);
  r.integer("default_pids_max", &out->default_pids_max, kMinPidsMax, kMaxPidsMax);
  r.integer("default_disk_mb", &out->default_disk_mb, 0, kMaxDiskMb);
  r.integer("store_free_space_reserve_mb", &out->store_free_space_reserve_mb, 0, 1024 * 1024);
  r.integer("checkpoint_flatten_layers", &out->checkpoint_flatten_layers, 2, 120);
  if (out->default_disk_mb != 0 && out->default_disk_mb < kMinDiskMb)
    r.error(*t.get("default_disk_mb"), "node.default_disk_mb",
            "must be 0 (no limit) or between " + std::to_string(kMinDiskMb) + " and " + std::to_string(kMaxDiskMb));
  // At least sandgate-init's relay chunk (64 KiB), so one chunk never overshoots the cap.
  r.integer("log_max_bytes", &out->log_max_bytes, 64 * 1024, 1024 * 1024 * 1024);
  r.boolean("default_allow_internet_access", &out->default_allow_internet_access);
  r.string("egress_bridge", &out->egress_bridge);
  if (out->egress_bridge.empty() || out->egress_bridge.size() > 8)
    r.error(t.get("egress_bridge") ? *t.get("egress_bridge") : static_cast<const toml::node&>(t), "node.egress_bridge",
            "must be 1-8 characters (its ports add a suffix to it)");
  r.string("egress_subnet", &out->egress_subnet);
  if (auto subnet = parse_egress_rule(out->egress_subnet);
      !subnet || subnet->port != 0 || subnet->prefix < 8 || subnet->prefix > 28)
    r.error(t.get("egress_subnet") ? *t.get("egress_subnet") : static_cast<const toml::node&>(t), "node.egress_subnet",
            subnet ? "must be an IPv4 network with a prefix of 8-28 and no port" : subnet.message());
  r.strings("deny_out", &out->deny_out, [](const std::string& text) -> Status {
    auto rule = parse_egress_rule(text);
    if (!rule) return rule.failure();
    return {};
  });
  r.string("qemu_binary", &out->qemu_binary);
  r.string("qemu_accel", &out->qemu_accel);
  if (out->qemu_accel != "auto" && out->qemu_accel != "kvm" && out->qemu_accel != "tcg")
    r.error(*t.get("qemu_accel"), "node.qemu_accel", "must be auto, kvm or tcg");
  r.string("guest_kernel", &out->guest_kernel);
  out->guest_kernel = resolve_path(base_dir, out->guest_kernel);
  r.string("guest_initrd", &out->guest_initrd);
  out->guest_initrd = resolve_path(base_dir, out->guest_initrd);
  r.boolean("guest_image_autobuild", &out->guest_image_autobuild);
  r.string("guest_image_builder", &out->guest_image_builder);
  out->guest_image_builder = resolve_path(base_dir, out->guest_image_builder);
  r.integer("qemu_boot_timeout_ms", &out->qemu_boot_timeout_ms, 1'000, 600'000);
  r.integer("qemu_boot_attempts", &out->qemu_boot_attempts, 1, 10);
  r.string("qemu_image", &out->qemu_image);
  r.string("firecracker_binary", &out->firecracker_binary);
  out->firecracker_binary = resolve_path(base_dir, out->firecracker_binary);
  r.string("cloud_hypervisor_binary", &out->cloud_hypervisor_binary);
  out->cloud_hypervisor_binary = resolve_path(base_dir, out->cloud_hypervisor_binary);
}

bool valid_domain(std::string_view d) {
  if (d.empty() || d.size() > 200 || d.front() == '.' || d.back() == '.') return false;
  size_t label = 0;
  for (char c : d) {
    if (c == '.') {
      if (label == 0) return false;
      label = 0;
      continue;
    }
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-')) return false;
    if (++label > 63) return false;
  }
  return true;
}

// toml++ 3.3.0 (Debian 12) reaches __builtin_unreachable() -- undefined behaviour: a crash, or worse in a
// release build -- when its whitespace test (is_non_ascii_horizontal_whitespace, impl/unicode_autogenerated.h)
// meets a code point in three blocks of its lookup table that it does not handle: U+00A1..U+0499,
// U+2C5E..U+3057 but U+3000, U+FB26..U+FEFE. Found by tests/fuzz/config_fuzz. This is the same computation,
// so exactly those code points are refused before toml++ sees the text, wherever they are: refusing them only
// where the parser tests for whitespace would take a TOML lexer of our own, and a config rarely needs them.
bool trips_toml_whitespace_table(char32_t c) {
  if (c <= 0xA0 || c >= 0xFEFF || c == 0x3000) return false;
  const uint64_t block = (uint64_t{c} - 0xA0) / 0x3FA;
  return block == 0 || block == 11 || block == 63;
}

// TOML allows no raw control character but tab, LF and CR anywhere (a string spells one as an escape), and
// toml++ 3.3.0 fails an internal assertion on some of them (a NUL in a table header: parse_key, found by
// config_fuzz once assertions were on), so they are refused here with their line, before it parses.
bool raw_control_character(unsigned char c) { return (c < 0x20 && c != '\t' && c != '\n' && c != '\r') || c == 0x7F; }

// The first such code point (decoded from well-formed UTF-8; toml++ refuses ill-formed sequences itself) or
// control character as "<source>:<line>: ...", or ok.
Status check_toml_safe(std::string_view text, std::string_view source_name) {
  size_t line = 1;
  auto refuse = [&](char32_t c, std::string_view what, std::string_view why) {
    char code[16];
    std::snprintf(code, sizeof code, "U+%04X", static_cast<unsigned>(c));
    return fail(Error::kInvalidArgument, std::string(source_name) + ":" + std::to_string(line) + ": " +
                                             std::string(what) + " " + code + " " + std::string(why));
  };
  for (size_t i = 0; i < text.size();) {
    const auto lead = static_cast<unsigned char>(text[i]);
    if (lead == '\n') ++line;
    if (raw_control_character(lead))
      return refuse(lead, "control character", "is not allowed in TOML (in a string, write it as an escape)");
    const size_t len = lead < 0xC0 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
    bool well_formed = len > 1 && i + len <= text.size();
    char32_t c = lead & (0x7F >> len);
    for (size_t k = 1; well_formed && k < len; ++k) {
      const auto next = static_cast<unsigned char>(text[i + k]);
      well_formed = (next & 0xC0) == 0x80;
      c = (c << 6) | (next & 0x3F);
    }
    if (!well_formed) {
      ++i;
      continue;
    }
    if (trips_toml_whitespace_table(c))
      return refuse(c, "character", "is not accepted in the config file (the TOML parser, toml++ 3.3.0, mishandles it)");
    i += len;
  }
  return {};
}

}  // namespace

// The endpoint's host is numeric (parse_endpoint checked it).
bool is_loopback(const Endpoint& ep) {
  in_addr a4{};
  if (inet_pton(AF_INET, ep.host.c_str(), &a4) == 1) return (ntohl(a4.s_addr) >> 24) == 127;
  in6_addr a6{};
  return inet_pton(AF_INET6, ep.host.c_str(), &a6) == 1 && IN6_IS_ADDR_LOOPBACK(&a6);
}

std::string NodeConfig::guest_kernel_file() const {
  return guest_kernel.empty() ? state_dir + "/guest/vmlinuz" : guest_kernel;
}

std::string NodeConfig::guest_initrd_file() const {
  return guest_initrd.empty() ? state_dir + "/guest/initrd.img" : guest_initrd;
}

std::string NodeConfig::images_root() const { return images_dir.empty() ? state_dir : images_dir; }

uint16_t Config::url_port() const {
  if (proxy.public_port != 0) return proxy.public_port;
  return proxy.listen.empty() ? 443 : proxy.listen.front().port;
}

std::string Config::port_url(uint16_t port, std::string_view name) const {
  std::string url = "https://" + std::to_string(port) + "-" + std::string(name) + "." + domain;
  if (url_port() != 443) url += ":" + std::to_string(url_port());
  return url + "/";
}

Result<std::shared_ptr<const Config>> load_config_string(std::string_view text, std::string_view source_name,
                                                         const std::string& base_dir) {
  if (auto safe = check_toml_safe(text, source_name); !safe) return safe.failure();
  toml::parse_result parsed = toml::parse(text, source_name);
  if (!parsed) {
    const auto& err = parsed.error();
    return fail(Error::kInvalidArgument, std::string(source_name) + ":" + std::to_string(err.source().begin.line) +
                                             ": " + std::string(err.description()));
  }
  const toml::table& root = parsed.table();
  auto cfg = std::make_shared<Config>();
  cfg->source = std::string(source_name);
  cfg->node_socket = Endpoint{Endpoint::Kind::kUnix, "", 0, "/run/sandgate/node.sock"};
  cfg->proxy.listen = {*parse_endpoint("127.0.0.1:8443")};
  std::vector<std::string> errors;
  {
    TableReader r(root, "", source_name, &errors);
    r.string("domain", &cfg->domain);
    if (!valid_domain(cfg->domain) && r.find("domain"))
      r.error(*root.get("domain"), "domain", "must be a lowercase DNS name such as sandbox.example.com");
    std::vector<Endpoint> sock;
    r.endpoints("node_socket", &sock, true);
    if (!sock.empty()) {
      if (sock.size() != 1 || sock[0].kind != Endpoint::Kind::kUnix)
        r.error(*root.get("node_socket"), "node_socket", "must be one unix:/path");
      else
        cfg->node_socket = sock[0];
    }
    cfg->node_socket.path = resolve_path(base_dir, cfg->node_socket.path);
    r.string("log_level", &cfg->log_level);
    static const std::set<std::string> kLevels = {"trace", "debug", "info", "warn", "error", "off"};
    if (!kLevels.count(cfg->log_level))
      r.error(*root.get("log_level"), "log_level", "must be one of trace, debug, info, warn, error, off");
    r.integer("agent_port", &cfg->agent_port, 1, 65535);
    r.string("operator_token_file", &cfg->operator_token_file);
    cfg->operator_token_file = resolve_path(base_dir, cfg->operator_token_file);
    for (const char* section : {"proxy", "node", "fleet"}) {
      const toml::node* n = r.find(section);
      if (!n) continue;
      const toml::table* t = n->as_table();
      if (!t) {
        r.error(*n, section, "must be a table");
        continue;
      }
      if (std::string_view(section) == "proxy") read_proxy(*t, source_name, base_dir, &errors, &cfg->proxy);
      else if (std::string_view(section) == "node") read_node(*t, source_name, base_dir, &errors, &cfg->node);
      else read_fleet(*t, source_name, base_dir, &errors, &cfg->fleet);
    }
  }
  if (cfg->proxy.listen.empty()) errors.push_back(std::string(source_name) + ": proxy.listen: needs at least one address");
  // The TCP API authenticates with the operator token only; without one it could only refuse everything.
  if (!cfg->node.api_listen.empty() && cfg->operator_token_file.empty())
    errors.push_back(std::string(source_name) +
                     ": node.api_listen: needs operator_token_file (the TCP API requires the operator token)");
  if (!errors.empty()) {
    std::string joined;
    for (auto& e : errors) joined += (joined.empty() ? "" : "\n") + e;
    return fail(Error::kInvalidArgument, joined);
  }
  return std::shared_ptr<const Config>(std::move(cfg));
}

Result<std::shared_ptr<const Config>> load_config_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return fail(Error::kNotFound, "cannot read config file " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  auto slash = path.rfind('/');
  std::string base_dir = slash == std::string::npos ? "." : path.substr(0, slash == 0 ? 1 : slash);
  return load_config_string(ss.str(), path, base_dir);
}

}  // namespace sg
