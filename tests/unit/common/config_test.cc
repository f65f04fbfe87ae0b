#include "config/config.h"

#include <grp.h>
#include <gtest/gtest.h>
#include <pwd.h>

#include <filesystem>
#include <fstream>

#include "tests/unit/test_cert.h"

namespace sg {
namespace {

Result<std::shared_ptr<const Config>> load(std::string_view text) { return load_config_string(text, "t.toml", "/base"); }

TEST(Config, EmptyFileGivesDefaults) {
  auto c = load("");
  ASSERT_TRUE(c.ok()) << c.message();
  EXPECT_EQ((*c)->domain, "sandbox.localhost");
  ASSERT_EQ((*c)->proxy.listen.size(), 1u);
  EXPECT_EQ((*c)->proxy.listen[0].to_string(), "127.0.0.1:8443");
  EXPECT_EQ((*c)->proxy.wake_timeout_ms, 30000u);
  EXPECT_EQ((*c)->proxy.max_connections_per_client, 256u);
  EXPECT_EQ((*c)->proxy.tls13_session_tickets, 1u);
  EXPECT_EQ((*c)->proxy.tls_ticket_key_rotation_secs, 3600u);
  EXPECT_EQ((*c)->node.on_shutdown, ShutdownPolicy::kKeep);
  EXPECT_TRUE((*c)->node.batch_scheduling);
}

// tests/fuzz/config_fuzz found these: toml++ 3.3.0 hits __builtin_unreachable() on some non-ASCII code
// points (U+025C after a value here). They get an error with the line; their neighbours still parse.
TEST(Config, CodePointsTomlMishandlesAreRefusedWithTheirLine) {
  static const char kCrash[] = "domain = \"sandbox.localhost\"\n"
                               "[proxy]\n"
                               "listen = \"126.0.0.1:8443\"\n"
                               "workekers = 2\n"
                               "ktls =+\"\x10\x00\x00\x00\x00\x00\x00\x00proxy\xC9\x9C"
                               "ertificat0.0.1:7070\"\n";
  const std::string crash(kCrash, sizeof kCrash - 1);
  auto cfg = load_config_string(crash, "t.toml");
  ASSERT_FALSE(cfg);
  EXPECT_EQ(cfg.message(), "t.toml:5: control character U+0010 is not allowed in TOML (in a string, write it as "
                           "an escape)");
  // The same with the control characters gone: the code point toml++ mishandles is what is refused.
  std::string printable = crash;
  std::erase_if(printable, [](char ch) { return ch == '\x10' || ch == '\0'; });
  cfg = load_config_string(printable, "t.toml");
  ASSERT_FALSE(cfg);
  EXPECT_EQ(cfg.message(), "t.toml:5: character U+025C is not accepted in the config file (the TOML parser, "
                           "toml++ 3.3.0, mishandles it)");
  for (const char* text : {"a = 1\xC2\xA1\n", "# \xE3\x80\x81\n", "d = \"\xEF\xBB\xBE\"\n"}) {
    auto refused = load_config_string(text, "t.toml");
    ASSERT_FALSE(refused) << text;
    EXPECT_NE(refused.message().find("is not accepted"), std::string::npos) << refused.message();
  }
  // Just outside those blocks (U+00A0, U+049A, U+3000, in a comment) toml++ works.
  EXPECT_TRUE(load_config_string("domain = \"sandbox.localhost\"\n# \xC2\xA0 \xD2\x9A \xE3\x80\x80\n", "t.toml"));
}

// config_fuzz (assertions on): a NUL in a table header failed toml++'s assertion in parse_key.
TEST(Config, RawControlCharactersAreRefusedWithTheirLine) {
  static const char kHeader[] = "domain = \"sandbox.localhost\"\n[\0p\0r\0ox\0\0y]\nworkers = 2\n";
  auto cfg = load_config_string(std::string(kHeader, sizeof kHeader - 1), "t.toml");
  ASSERT_FALSE(cfg);
  EXPECT_EQ(cfg.message(), "t.toml:2: control character U+0000 is not allowed in TOML (in a string, write it as "
                           "an escape)");
  for (const char* text : {"a = \"\x01\"\n", "# \x1b[31m\n", "\n\na = 1\x7f\n"}) {
    auto refused = load_config_string(text, "t.toml");
    ASSERT_FALSE(refused) << text;
    EXPECT_NE(refused.message().find("control character"), std::string::npos) << refused.message();
  }
  EXPECT_EQ(load_config_string("\n\na = 1\x7f\n", "t.toml").message().substr(0, 8), "t.toml:3");
  // Tab, CR LF and escapes are TOML and stay accepted.
  EXPECT_TRUE(load_config_string("domain =\t\"sandbox.localhost\"\r\n# \\u0001\r\n", "t.toml"));
}

// config_fuzz (assertions on): a table header whose key starts with a character no key starts with failed
// toml++'s assertion in parse_key (and is __builtin_assume under clang with NDEBUG). It is an error with
// its line in every build, like any other malformed header.
TEST(Config, TableHeadersWhoseKeyCannotStartThereAreAnErrorWithTheirLine) {
  for (const char* header : {"[***[proxy.certificates]]", "[[*]]", "[ =]", "[.proxy]", "[[ {a = 1}]]"}) {
    const std::string text = std::string("domain = \"sandbox.localhost\"\n[proxy]\nworkers = 2\n\n") + header +
                             "\ncert = \"cert.pem\"\n";
    auto cfg = load_config_string(text, "t.toml");
    ASSERT_FALSE(cfg) << header;
    EXPECT_EQ(cfg.message().substr(0, 9), "t.toml:5:") << header << ": " << cfg.message();
    EXPECT_NE(cfg.message().find("expected bare key starting character"), std::string::npos) << cfg.message();
  }
  // Quoted and spaced keys are TOML and stay accepted.
  EXPECT_TRUE(load_config_string("domain = \"sandbox.localhost\"\n[ \"proxy\" ]\nworkers = 2\n", "t.toml"));
}

TEST(Config, FullFile) {
  auto c = load(R"(
domain = "sb.example.com"
node_socket = "unix:run/node.sock"
log_level = "debug"
[proxy]
listen = ["127.0.0.1:9443", "[::1]:9443"]
workers = 3
max_request_head_bytes = 4096
ktls = "off"
tls_own_record_layer = false
[[proxy.certificates]]
cert = "tls/cert.pem"
key = "/abs/key.pem"
[node]
state_dir = "state"
on_shutdown = "terminate"
cgroup_name = "sg-test"
batch_scheduling = false
)");
  ASSERT_TRUE(c.ok()) << c.message();
  const Config& cfg = **c;
  EXPECT_EQ(cfg.domain, "sb.example.com");
  EXPECT_EQ(cfg.node_socket.path, "/base/run/node.sock");
  EXPECT_EQ(cfg.proxy.listen.size(), 2u);
  EXPECT_EQ(cfg.proxy.workers, 3u);
  EXPECT_EQ(cfg.proxy.ktls, KtlsMode::kOff);
  EXPECT_FALSE(cfg.proxy.tls_own_record_layer);
  ASSERT_EQ(cfg.proxy.certificates.size(), 1u);
  EXPECT_EQ(cfg.proxy.certificates[0].cert_file, "/base/tls/cert.pem");
  EXPECT_EQ(cfg.proxy.certificates[0].key_file, "/abs/key.pem");
  EXPECT_EQ(cfg.node.state_dir, "/base/state");
  EXPECT_EQ(cfg.node.on_shutdown, ShutdownPolicy::kTerminate);
  EXPECT_FALSE(cfg.node.batch_scheduling);
  EXPECT_EQ(cfg.port_url(8080, "demo"), "https://8080-demo.sb.example.com:9443/");
}

struct BadCase {
  const char* text;
  const char* expected;  // substring of the error: file:line: key: reason
};

TEST(Config, ErrorsNameFileLineAndKey) {
  const BadCase cases[] = {
      {"[proxy]\nworkerz = 2\n", "t.toml:2: proxy.workerz: unknown key"},
      {"colour = 1\n", "t.toml:1: colour: unknown key"},
      {"[proxy]\nworkers = \"two\"\n", "t.toml:2: proxy.workers: must be an integer"},
      {"[proxy]\nworkers = 100000\n", "t.toml:2: proxy.workers: must be between 0 and 256"},
      {"[proxy]\nmax_connections = 0\n", "proxy.max_connections: must be between 1"},
      {"[proxy]\nmax_connections_per_client = 0\n", "t.toml:2: proxy.max_connections_per_client: must be between 1"},
      {"[proxy]\nlisten = \"nonsense\"\n", "t.toml:2: proxy.listen: expected host:port"},
      {"[proxy]\nlisten = \"example.com:443\"\n", "not a numeric IP address"},
      {"[proxy]\nlisten = \"127.0.0.1:99999\"\n", "invalid port"},
      {"[proxy]\nktls = \"maybe\"\n", "t.toml:2: proxy.ktls: must be one of auto, on, off"},
      {"[proxy]\ntls13_session_tickets = 9\n", "t.toml:2: proxy.tls13_session_tickets: must be between 0 and 8"},
      {"[proxy]\ntls_ticket_key_rotation_secs = 59\n",
       "t.toml:2: proxy.tls_ticket_key_rotation_secs: must be between 60 and 604800"},
      {"[[proxy.certificates]]\ncert = \"a.pem\"\n", "needs both cert and key"},
      {"[node]\non_shutdown = \"explode\"\n", "t.toml:2: node.on_shutdown"},
      {"[node]\ncgroup_name = \"../escape\"\n", "node.cgroup_name"},
      {"[node]\nguest_image_autobuild = \"yes\"\n", "t.toml:2: node.guest_image_autobuild: must be true or false"},
      {"domain = \"Bad_Domain\"\n", "t.toml:1: domain"},
      {"log_level = \"loud\"\n", "log_level"},
      {"proxy = 3\n", "proxy: must be a table"},
      {"[proxy\n", "t.toml:1:"},
      {"node_socket = \"127.0.0.1:1\"\n", "node_socket: must be one unix:/path"},
  };
  for (const auto& bc : cases) {
    auto c = load(bc.text);
    ASSERT_FALSE(c.ok()) << bc.text;
    EXPECT_NE(c.message().find(bc.expected), std::string::npos) << "got: " << c.message() << "\nwant: " << bc.expected;
  }
}

TEST(Config, GuestImageKeys) {
  auto d = load("[node]\nstate_dir = \"/s\"\n");
  ASSERT_TRUE(d.ok()) << d.message();
  EXPECT_TRUE((*d)->node.guest_image_autobuild);
  EXPECT_EQ((*d)->node.guest_image_builder, "");
  EXPECT_EQ((*d)->node.guest_kernel_file(), "/s/guest/vmlinuz");
  EXPECT_EQ((*d)->node.guest_initrd_file(), "/s/guest/initrd.img");
  auto c = load("[node]\nguest_image_autobuild = false\nguest_image_builder = \"b.sh\"\nguest_kernel = \"k\"\n");
  ASSERT_TRUE(c.ok()) << c.message();
  EXPECT_FALSE((*c)->node.guest_image_autobuild);
  EXPECT_EQ((*c)->node.guest_image_builder, "/base/b.sh");
  EXPECT_EQ((*c)->node.guest_kernel_file(), "/base/k");
}

// The process sandbox boundary's keys: defaults, paths resolved against the file, and every bound.
TEST(Config, SandboxBoundaryKeys) {
  auto d = load("[node]\nstate_dir = \"/s\"\n");
  ASSERT_TRUE(d.ok()) << d.message();
  EXPECT_EQ((*d)->node.images_root(), "/s");
  EXPECT_EQ((*d)->node.default_image, "default");
  EXPECT_EQ((*d)->node.uid_range_base, 0x10000000u);
  EXPECT_EQ((*d)->node.default_pids_max, 1024u);
  EXPECT_EQ((*d)->node.log_max_bytes, 8u * 1024 * 1024);
  auto c = load("[node]\nimages_dir = \"img\"\ndefault_image = \"py\"\nuid_range_base = 1048576\n"
                "default_pids_max = 8\nlog_max_bytes = 65536\ndefault_disk_mb = 16\n"
                "store_free_space_reserve_mb = 0\nmax_memory_mb = 65536\nmax_cpus = 16\n"
                "checkpoint_flatten_layers = 4\n");
  ASSERT_TRUE(c.ok()) << c.message();
  EXPECT_EQ((*c)->node.max_memory_mb, 65536u);
  EXPECT_EQ((*c)->node.max_cpus, 16u);
  EXPECT_EQ((*d)->node.max_memory_mb, 0u);
  EXPECT_EQ((*d)->node.max_cpus, 0u);
  EXPECT_EQ((*c)->node.images_root(), "/base/img");
  EXPECT_EQ((*c)->node.default_image, "py");
  EXPECT_EQ((*c)->node.uid_range_base, 1048576u);
  EXPECT_EQ((*c)->node.default_pids_max, 8u);
  EXPECT_EQ((*c)->node.log_max_bytes, 65536u);
  EXPECT_EQ((*c)->node.default_disk_mb, 16u);
  EXPECT_EQ((*d)->node.default_disk_mb, 0u);
  EXPECT_EQ((*c)->node.store_free_space_reserve_mb, 0u);
  EXPECT_EQ((*d)->node.store_free_space_reserve_mb, 1024u);
  EXPECT_EQ((*c)->node.checkpoint_flatten_layers, 4u);
  EXPECT_EQ((*d)->node.checkpoint_flatten_layers, 32u);
  for (const char* bad : {"uid_range_base = 1048575", "uid_range_base = 3221225473", "default_pids_max = 7",
                          "default_pids_max = 4194305", "log_max_bytes = 65535", "log_max_bytes = 1073741825", "default_disk_mb = 15",
                          "default_disk_mb = 16777217", "max_memory_mb = -1", "max_cpus = 1048577",
                          "checkpoint_flatten_layers = 1", "checkpoint_flatten_layers = 121"}) {
    auto r = load(std::string("[node]\n") + bad + "\n");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.message().find("t.toml:2: node." + std::string(bad).substr(0, std::string(bad).find(' '))),
              std::string::npos)
        << r.message();
  }
}

TEST(Config, ApiListenIsLoopbackOnlyUnlessAllowedAndNeedsTheOperatorToken) {
  const std::string token = "operator_token_file = \"op.token\"\n";
  for (const char* addr : {"127.0.0.1:8081", "127.0.0.2:8081", "[::1]:8081", "localhost:8081"}) {
    auto c = load(token + "[node]\napi_listen = \"" + addr + "\"\n");
    ASSERT_TRUE(c.ok()) << addr << ": " << c.message();
    EXPECT_FALSE((*c)->node.api_listen_allow_remote);
  }
  for (const char* addr : {"0.0.0.0:8081", "[::]:8081", "10.1.2.3:8081", "[fe80::1]:8081"}) {
    auto c = load(token + "[node]\napi_listen = [\"127.0.0.1:8081\", \"" + addr + "\"]\n");
    ASSERT_FALSE(c.ok()) << addr;
    EXPECT_NE(c.message().find("t.toml:3: node.api_listen: "), std::string::npos) << c.message();
    EXPECT_NE(c.message().find("is not a loopback address"), std::string::npos) << c.message();
    EXPECT_NE(c.message().find("node.api_listen_allow_remote = true"), std::string::npos) << c.message();
    auto allowed = load(token + "[node]\napi_listen = \"" + addr + "\"\napi_listen_allow_remote = true\n");
    ASSERT_TRUE(allowed.ok()) << addr << ": " << allowed.message();
    EXPECT_TRUE((*allowed)->node.api_listen_allow_remote);
  }
  auto typo = load(token + "[node]\napi_listen_allow_remote = \"yes\"\n");
  ASSERT_FALSE(typo.ok());
  EXPECT_NE(typo.message().find("node.api_listen_allow_remote: must be true or false"), std::string::npos);
  // The TCP API's only credential is the operator token: without one, listening there is a config error.
  auto no_token = load("[node]\napi_listen = \"127.0.0.1:8081\"\n");
  ASSERT_FALSE(no_token.ok());
  EXPECT_NE(no_token.message().find("node.api_listen: needs operator_token_file"), std::string::npos)
      << no_token.message();
}

// Some user of this machine that is not root and whose primary group is not root's, and that group's name
// (Debian: nobody / nogroup); empty if there is none.
std::pair<std::string, std::string> unprivileged_account() {
  std::pair<std::string, std::string> found;
  ::setpwent();
  while (passwd* pw = ::getpwent()) {
    group* gr = pw->pw_uid != 0 && pw->pw_gid != 0 ? ::getgrgid(pw->pw_gid) : nullptr;
    if (gr) {
      found = {pw->pw_name, gr->gr_name};
      break;
    }
  }
  ::endpwent();
  return found;
}

TEST(Config, ProxyUserGroupAndSocketGroupMustExist) {
  auto [user, group] = unprivileged_account();
  ASSERT_FALSE(user.empty()) << "no unprivileged user in the passwd database";
  const std::string missing = "sg-no-such-account-3f9c";
  ASSERT_EQ(::getpwnam(missing.c_str()), nullptr);
  ASSERT_EQ(::getgrnam(missing.c_str()), nullptr);

  auto defaults = load("");
  ASSERT_TRUE(defaults.ok());
  EXPECT_EQ((*defaults)->proxy.user, "") << "dropping root is opt-in: the quickstart runs as whoever starts it";
  EXPECT_EQ((*defaults)->proxy.group, "");
  EXPECT_EQ((*defaults)->node.socket_group, "");

  auto ok = load("[proxy]\nuser = \"" + user + "\"\ngroup = \"" + group + "\"\n[node]\nsocket_group = \"" + group +
                 "\"\n");
  ASSERT_TRUE(ok.ok()) << ok.message();
  EXPECT_EQ((*ok)->proxy.user, user);
  EXPECT_EQ((*ok)->proxy.group, group);
  EXPECT_EQ((*ok)->node.socket_group, group);
  // Root's group is what the socket has without the key, so naming it is allowed.
  EXPECT_TRUE(load("[node]\nsocket_group = \"root\"\n").ok());

  const std::pair<std::string, std::string> bad[] = {
      {"[proxy]\nuser = \"" + missing + "\"\n", "t.toml:2: proxy.user: no user named \"" + missing + "\""},
      {"[proxy]\nuser = \"root\"\n", "t.toml:2: proxy.user: \"root\" is root (uid 0)"},
      {"[proxy]\nuser = 65534\n", "t.toml:2: proxy.user: must be a string"},
      {"[proxy]\nuser = \"" + user + "\"\ngroup = \"" + missing + "\"\n",
       "t.toml:3: proxy.group: no group named \"" + missing + "\""},
      {"[proxy]\nuser = \"" + user + "\"\ngroup = \"root\"\n", "t.toml:3: proxy.group: \"root\" is the root group"},
      {"[proxy]\ngroup = \"" + group + "\"\n", "t.toml:2: proxy.group: needs proxy.user"},
      {"[node]\nsocket_group = \"" + missing + "\"\n", "t.toml:2: node.socket_group: no group named"},
  };
  for (const auto& [text, expected] : bad) {
    auto c = load(text);
    ASSERT_FALSE(c.ok()) << text;
    EXPECT_NE(c.message().find(expected), std::string::npos) << "got: " << c.message() << "\nwant: " << expected;
  }
}

TEST(Config, AllErrorsReportedAtOnce) {
  auto c = load("[proxy]\nworkers = -1\nfoo = 1\n");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.message().find("proxy.workers"), std::string::npos);
  EXPECT_NE(c.message().find("proxy.foo"), std::string::npos);
}

// The example file is what deploy/install.sh and the container image install: it must load, and the values
// it shows must be the defaults it says they are.
TEST(Config, TheExampleFileLoadsAndShowsTheDefaults) {
  auto example = load_config_file(std::string(SANDGATE_SOURCE_DIR) + "/deploy/sandgate.example.toml");
  ASSERT_TRUE(example.ok()) << example.message();
  auto defaults = load("");
  ASSERT_TRUE(defaults.ok()) << defaults.message();
  const ProxyConfig& e = (*example)->proxy;
  const ProxyConfig& d = (*defaults)->proxy;
  EXPECT_EQ(e.workers, d.workers);
  EXPECT_EQ(e.ktls, d.ktls);
  EXPECT_EQ(e.tls_own_record_layer, d.tls_own_record_layer);
  EXPECT_TRUE(d.tls_own_record_layer);
  EXPECT_EQ(e.handshake_timeout_ms, d.handshake_timeout_ms);
  EXPECT_EQ(e.tls13_session_tickets, d.tls13_session_tickets);
  EXPECT_EQ(e.tls_ticket_key_rotation_secs, d.tls_ticket_key_rotation_secs);
  EXPECT_EQ(e.tls_ticket_key_file, d.tls_ticket_key_file);
  EXPECT_EQ(d.tls_ticket_key_file, "");
  EXPECT_EQ(e.request_head_timeout_ms, d.request_head_timeout_ms);
  EXPECT_EQ(e.max_request_head_bytes, d.max_request_head_bytes);
  EXPECT_EQ(e.max_connections, d.max_connections);
  EXPECT_EQ(e.max_connections_per_sandbox, d.max_connections_per_sandbox);
  EXPECT_EQ(e.max_connections_per_client, d.max_connections_per_client);
  EXPECT_EQ(e.wake_timeout_ms, d.wake_timeout_ms);
  EXPECT_EQ(e.idle_timeout_secs, d.idle_timeout_secs);
  EXPECT_EQ((*example)->node.batch_scheduling, (*defaults)->node.batch_scheduling);
}

TEST(Config, MissingFile) {
  auto c = load_config_file("/nonexistent/sandgate.toml");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error(), Error::kNotFound);
}

TEST(ConfigHolder, SwapIsWholeSnapshot) {
  auto a = load("domain = \"a.test\"");
  auto b = load("domain = \"b.test\"");
  ConfigHolder holder(*a);
  auto held = holder.get();
  holder.swap(*b);
  EXPECT_EQ(held->domain, "a.test");  // a reader keeps its snapshot
  EXPECT_EQ(holder.get()->domain, "b.test");
}

TEST(Config, FleetAbsentIsTheSingleNodeDefault) {
  auto cfg = load("");
  ASSERT_TRUE(cfg) << cfg.message();
  EXPECT_FALSE((*cfg)->fleet.enabled);
}

TEST(Config, FleetKeys) {
  auto cfg = load(
      "[fleet]\netcd_endpoints = [\"http://127.0.0.1:2379\", \"127.0.0.2:2379\"]\nnode_name = \"n-1\"\n"
      "advertise_api = \"https://10.0.0.1:9444\"\nadvertise_ingress = \"10.0.0.1:9443\"\nlease_ttl_secs = 3\n"
      "capacity_sandboxes = 50\napi_cacert = \"/etc/sandgate/fleet-ca.pem\"\n");
  ASSERT_TRUE(cfg) << cfg.message();
  const FleetConfig& f = (*cfg)->fleet;
  EXPECT_EQ(f.api_cacert, "/etc/sandgate/fleet-ca.pem");
  EXPECT_TRUE(f.enabled);
  EXPECT_EQ(f.etcd_endpoints.size(), 2u);
  EXPECT_EQ(f.node_name, "n-1");
  EXPECT_EQ(f.lease_ttl_secs, 3u);
  EXPECT_EQ(f.capacity_sandboxes, 50u);
  auto defaults = load("[fleet]\netcd_endpoints = \"127.0.0.1:2379\"\nnode_name = \"a\"\n");
  ASSERT_TRUE(defaults) << defaults.message();
  EXPECT_EQ((*defaults)->fleet.lease_ttl_secs, 10u);
}

TEST(Config, FleetErrorsNameTheKey) {
  auto cfg = load("[fleet]\netcd_endpoints = [\"https://x:1\"]\nnode_name = \"Bad_Name\"\nlease_ttl_secs = 1\n"
                  "advertise_api = \"a b\"\n");
  ASSERT_FALSE(cfg);
  EXPECT_NE(cfg.message().find("t.toml:2: fleet.etcd_endpoints: etcd member https://x:1"), std::string::npos) << cfg.message();
  EXPECT_NE(cfg.message().find("t.toml:3: fleet.node_name"), std::string::npos) << cfg.message();
  EXPECT_NE(cfg.message().find("t.toml:4: fleet.lease_ttl_secs: must be between 2 and 300"), std::string::npos) << cfg.message();
  EXPECT_NE(cfg.message().find("t.toml:5: fleet.advertise_api"), std::string::npos) << cfg.message();
  auto empty = load("[fleet]\n");
  ASSERT_FALSE(empty);
  EXPECT_NE(empty.message().find("fleet.etcd_endpoints: needs at least one etcd member"), std::string::npos);
  EXPECT_NE(empty.message().find("fleet.node_name"), std::string::npos);
  // Other nodes place creates at advertise_api: one they could not use is refused at load, naming the key.
  auto other_scheme = load("[fleet]\netcd_endpoints = \"127.0.0.1:2379\"\nnode_name = \"a\"\n"
                           "advertise_api = \"tcp://10.0.0.1:8081\"\n");
  ASSERT_FALSE(other_scheme);
  EXPECT_NE(other_scheme.message().find("t.toml:4: fleet.advertise_api: invalid node API address"), std::string::npos)
      << other_scheme.message();
}

// TLS to etcd: the files load at config time (as nginx -t checks its certificates), and settings that
// would not be used, or only half of a pair, are refused.
TEST(Config, FleetEtcdTls) {
  const char* tmp = std::getenv("TMPDIR");
  std::string dir = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/sg-config-etcd-XXXXXX";
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  test_support::TestCert cert;
  cert.write_pem(dir + "/ca.pem");
  cert.write_pem(dir + "/client.pem");
  cert.write_key_pem(dir + "/client.key");
  const std::string head = "[fleet]\nnode_name = \"a\"\n";
  auto ok = load(head + "etcd_endpoints = [\"https://10.0.0.5:2379\", \"https://[fd00::5]:2379\"]\n"
                 "etcd_cacert = \"" + dir + "/ca.pem\"\netcd_cert = \"" + dir + "/client.pem\"\n"
                 "etcd_key = \"" + dir + "/client.key\"\netcd_server_name = \"etcd.internal\"\n");
  ASSERT_TRUE(ok) << ok.message();
  EXPECT_EQ((*ok)->fleet.etcd_cacert, dir + "/ca.pem");
  EXPECT_EQ((*ok)->fleet.etcd_server_name, "etcd.internal");
  // https:// alone: the system's trust store, no client certificate.
  EXPECT_TRUE(load(head + "etcd_endpoints = \"https://10.0.0.5:2379\"\n"));
  auto clear_text = load(head + "etcd_endpoints = \"http://10.0.0.5:2379\"\netcd_cacert = \"" + dir + "/ca.pem\"\n");
  ASSERT_FALSE(clear_text);
  EXPECT_NE(clear_text.message().find("but no member is https://"), std::string::npos) << clear_text.message();
  auto half = load(head + "etcd_endpoints = \"https://10.0.0.5:2379\"\netcd_cert = \"" + dir + "/client.pem\"\n");
  ASSERT_FALSE(half);
  EXPECT_NE(half.message().find("t.toml:4: fleet.etcd_cert: etcd_cert and etcd_key go together"), std::string::npos)
      << half.message();
  auto missing = load(head + "etcd_endpoints = \"https://10.0.0.5:2379\"\netcd_cacert = \"" + dir + "/none.pem\"\n");
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.message().find("t.toml:4: fleet.etcd_cacert: etcd TLS: cannot load the CA certificates from " + dir +
                                   "/none.pem"),
            std::string::npos)
      << missing.message();
  // A key that does not load names etcd_key.
  std::ofstream(dir + "/bad.key") << "not a key\n";
  auto bad_key = load(head + "etcd_endpoints = \"https://10.0.0.5:2379\"\netcd_cert = \"" + dir +
                      "/client.pem\"\netcd_key = \"" + dir + "/bad.key\"\n");
  ASSERT_FALSE(bad_key);
  EXPECT_NE(bad_key.message().find("t.toml:5: fleet.etcd_key: etcd TLS: cannot load the client key"), std::string::npos)
      << bad_key.message();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace sg

namespace sg {
namespace {

TEST(Config, EgressKeys) {
  auto defaults = load("");
  ASSERT_TRUE(defaults) << defaults.message();
  EXPECT_FALSE((*defaults)->node.default_allow_internet_access);
  EXPECT_EQ((*defaults)->node.egress_bridge, "sgbr0");
  EXPECT_EQ((*defaults)->node.egress_subnet, "10.200.0.0/16");
  auto cfg = load("[node]\ndefault_allow_internet_access = true\negress_bridge = \"br9\"\n"
                  "egress_subnet = \"10.9.0.0/20\"\ndeny_out = [\"192.0.2.0/24\", \"198.51.100.7:25\"]\n");
  ASSERT_TRUE(cfg) << cfg.message();
  EXPECT_TRUE((*cfg)->node.default_allow_internet_access);
  EXPECT_EQ((*cfg)->node.egress_bridge, "br9");
  EXPECT_EQ((*cfg)->node.deny_out, (std::vector<std::string>{"192.0.2.0/24", "198.51.100.7:25"}));
  auto bad = load("[node]\negress_bridge = \"much-too-long\"\negress_subnet = \"10.9.0.0/30\"\n"
                  "deny_out = [\"192.0.2.0/24\", \"example.com\"]\n");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find("t.toml:2: node.egress_bridge"), std::string::npos) << bad.message();
  EXPECT_NE(bad.message().find("t.toml:3: node.egress_subnet"), std::string::npos) << bad.message();
  EXPECT_NE(bad.message().find("t.toml:4: node.deny_out: egress rule \"example.com\""), std::string::npos)
      << bad.message();
}

}  // namespace
}  // namespace sg

namespace sg {
namespace {

TEST(Config, FleetHopKeysGoTogether) {
  auto cfg = load_config_string(
      "[proxy]\nfleet_listen = \"127.0.0.1:7443\"\nfleet_cert = \"fleet/a.pem\"\nfleet_key = \"fleet/a.key\"\n"
      "fleet_ca = \"/etc/fleet-ca.pem\"\n",
      "t.toml", "/base");
  ASSERT_TRUE(cfg) << cfg.message();
  ASSERT_EQ((*cfg)->proxy.fleet_listen.size(), 1u);
  EXPECT_EQ((*cfg)->proxy.fleet_listen[0].port, 7443);
  EXPECT_EQ((*cfg)->proxy.fleet_cert, "/base/fleet/a.pem");
  EXPECT_EQ((*cfg)->proxy.fleet_ca, "/etc/fleet-ca.pem");
  // Off by default: the single-node path.
  auto plain = load_config_string("", "t.toml");
  ASSERT_TRUE(plain);
  EXPECT_TRUE((*plain)->proxy.fleet_cert.empty());
  EXPECT_TRUE((*plain)->proxy.fleet_listen.empty());
  // A listener or a directory without the fleet's mutual TLS, or half of the TLS keys: errors with their line.
  auto bare = load_config_string("[proxy]\nfleet_listen = \"127.0.0.1:7443\"\n", "t.toml");
  ASSERT_FALSE(bare);
  EXPECT_NE(bare.message().find("t.toml:2: proxy.fleet_listen: needs proxy.fleet_cert"), std::string::npos)
      << bare.message();
  auto half = load_config_string("[proxy]\nfleet_cert = \"a.pem\"\n", "t.toml");
  ASSERT_FALSE(half);
  EXPECT_NE(half.message().find("go together"), std::string::npos) << half.message();
  EXPECT_FALSE(load_config_string("[proxy]\nfleet_listen = \"/run/x.sock\"\nfleet_cert = \"a\"\nfleet_key = \"b\"\n"
                                  "fleet_ca = \"c\"\n", "t.toml"));
}

}  // namespace
}  // namespace sg
