// End-to-end test harness: real sandgate-node and sandgate-proxy processes in a temp dir, driven with real
// clients (curl, openssl s_client, the sandgate CLI). Everything listens on loopback; ports come from the
// kernel (port 0) and are read back from the daemons' "ready" lines.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <csignal>
#include <unistd.h>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace sg::e2e {

struct CommandResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

// Runs `cmd` with /bin/sh; stdout and stderr captured separately. Killed after timeout_s.
CommandResult run(const std::string& cmd, int timeout_s = 120);
std::string shell_quote(const std::string& s);
// curl arguments for an `Authorization: Bearer <token>` header.
std::string bearer(const std::string& token);
std::string read_file(const std::string& path);
void write_file(const std::string& path, const std::string& data);
std::string sha256_file(const std::string& path);

// Polls `pred` every 20 ms until true or timeout; returns the last value.
template <typename Pred>
bool eventually(Pred pred, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    if (pred()) return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
    ::usleep(20'000);
  }
}

class Daemon {
 public:
  Daemon() = default;
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Starts argv with stdout+stderr appended to log_path, `env` ("NAME=value") added to this process's
  // environment; returns false if exec failed.
  bool start(const std::vector<std::string>& argv, const std::string& log_path,
             const std::vector<std::string>& env = {});
  // Waits until the log contains `needle` (after `from` bytes); returns the line containing it.
  std::string wait_for(const std::string& needle, int timeout_ms, size_t from = 0);
  // Sends sig and waits for exit (SIGKILL after timeout). Returns the exit status as from waitpid.
  int stop(int sig = SIGTERM, int timeout_ms = 15000);
  // Waits for the process to exit on its own: its status as from waitpid, or -1 if it still runs after
  // timeout_ms (it is left running).
  int wait_exit(int timeout_ms);
  bool running() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }
  std::string log() const { return read_file(log_path_); }

 private:
  pid_t pid_ = -1;
  std::string log_path_;
};

struct ClusterOptions {
  std::string proxy_extra;  // TOML lines appended to [proxy]
  std::string node_extra;   // TOML lines appended to [node]; "$CLUSTER_DIR" in them is the cluster's temp dir
  std::string operator_token;  // non-empty: written to a file that operator_token_file names
  bool start_proxy = true;

  static ClusterOptions proxy(std::string extra) {
    ClusterOptions o;
    o.proxy_extra = std::move(extra);
    return o;
  }
  static ClusterOptions node(std::string extra) {
    ClusterOptions o;
    o.node_extra = std::move(extra);
    return o;
  }
  // Node and proxy share an operator token file holding `token`.
  static ClusterOptions with_operator_token(std::string token) {
    ClusterOptions o;
    o.operator_token = std::move(token);
    return o;
  }
  static ClusterOptions node_only() {
    ClusterOptions o;
    o.start_proxy = false;
    return o;
  }
  // A node without the proxy and with an image store of its own in its state dir, not the test image's
  // shared one: for tests that import, build and remove images and look at the store's files.
  static ClusterOptions own_image_store() {
    ClusterOptions o = node_only();
    o.node_extra = "images_dir = \"\"\n";
    return o;
  }
};

class Cluster;
void ensure_test_image(Cluster& c);

class Cluster {
 public:
  explicit Cluster(ClusterOptions opts = {});
  ~Cluster();

  // `env` ("NAME=value") goes to the node only: SANDGATE_FAILPOINTS=... (docs/tests.md#failpoints).
  void start_node(const std::vector<std::string>& env = {});
  void start_proxy();
  int stop_node(int sig = SIGTERM);
  int stop_proxy(int sig = SIGTERM);

  // The sandgate CLI against this node: "sandgate --api unix:... <args>", run as sandgate() runs it.
  CommandResult cli(const std::string& args, int timeout_s = 60);
  // The command that starts the CLI, to prefix arguments with (also in an ssh ProxyCommand): it runs with
  // HOME and XDG_CONFIG_HOME inside this cluster's dir, so the tokens `create` saves never reach the real home.
  std::string sandgate() const;
  // That HOME; the CLI's config (tokens) is under home() + "/.config/sandgate".
  std::string home() const { return dir_ + "/home"; }
  // Creates a sandbox running tests/e2e/tools/testserver.py; returns its JSON (fails the test on error).
  nlohmann::json create_http_sandbox(const std::string& name, uint16_t port, const std::string& extra_flags = "");
  // A testserver.py sandbox whose port 8080 needs its token; returns that token once the port serves it.
  std::string create_private_serving(const std::string& name, const std::string& create_options = "");
  nlohmann::json get(const std::string& ref);
  // Waits until the backend answers through the proxy (the server needs a moment to listen).
  void wait_until_serving(const std::string& name, uint16_t port);

  // curl through the ingress, verifying the certificate against the test CA. Output: body then
  // "\n<http_code>" on the last line (curl -w).
  CommandResult curl(const std::string& host, const std::string& path = "/", const std::string& extra = "",
                     int timeout_s = 60);
  std::string url(const std::string& host, const std::string& path = "/") const;
  static int http_code(const CommandResult& r);
  // The body without curl's status line and without trailing newlines.
  static std::string body(const CommandResult& r);

  // Raw HTTP to the node API socket (for bad-input tests).
  CommandResult api_raw(const std::string& method, const std::string& path, const std::string& body);

  // How many requests for `path` (e.g. "/v1/internal/open") the node served: it logs each API request at
  // debug level, which the harness sets.
  size_t node_calls(const std::string& path);
  std::vector<nlohmann::json> access_log() const;
  // The port of the proxy's metrics listener, from its log (a config with metrics_listen = ["127.0.0.1:0"]);
  // 0 (and a failed expectation) when it never said.
  uint16_t metrics_port();
  // Polls the access log until an entry satisfies pred.
  nlohmann::json wait_access_entry(const std::function<bool(const nlohmann::json&)>& pred, int timeout_ms = 10000);

  // The real kernel freeze state of a sandbox's cgroup (v2 cgroup.events or v1 freezer.state).
  bool cgroup_frozen(const std::string& id) const;
  bool cgroup_exists(const std::string& id) const;

  const std::string& dir() const { return dir_; }
  const std::string& ca() const { return ca_; }
  const std::string& api() const { return api_; }
  uint16_t port() const { return port_; }
  Daemon& node() { return node_; }
  Daemon& proxy() { return proxy_; }
  std::string config_path() const { return dir_ + "/sandgate.toml"; }

 private:
  void write_config();
  // A test that names its own images_dir (the image tests) gets a store of its own.
  bool shares_test_image() const { return opts_.node_extra.find("images_dir") == std::string::npos; }

  ClusterOptions opts_;
  std::string dir_;
  std::string ca_;
  std::string api_;
  std::string cgroup_name_;
  uint16_t port_ = 0;
  Daemon node_;
  Daemon proxy_;
};

std::string bin(const std::string& relative);     // path under the build dir
std::string source(const std::string& relative);  // path under the source dir
// A sandbox sees only its image: the test image (tests/e2e/tools/make-test-image.sh) has every file of
// tests/e2e/tools (and a static h2_recorder) in this directory. tool("testserver.py") is its path there.
inline constexpr const char* kToolsInSandbox = "/sandgate-tests";
std::string tool(const std::string& name);
// sandgate-agent inside every sandbox (the node bind-mounts its own binary there).
inline constexpr const char* kAgentInSandbox = "/.sandgate/agent";

// The test image, shared by every node of every test process of a run: made (or found in its cache) by
// make-test-image.sh and imported into one layer store once. Clusters use it as the node's images_dir and
// default_image unless the test's node_extra sets images_dir itself.
struct TestImage {
  std::string store;  // node.images_dir
  std::string name;   // the image's name in it
  std::string archive;
};
const TestImage& test_image();

// What a command run through a sandbox's agent did.
struct Exec {
  int code = -1;
  std::string out;  // stdout and stderr, in order
};
// Runs `command` in sandbox `name` through the ingress and its agent's /exec, with the sandbox's token.
Exec exec_in(Cluster& c, const std::string& name, const std::string& token, const std::vector<std::string>& command,
             const std::string& stdin_text = "");
// exec_in of `/bin/sh -c script`.
Exec sh(Cluster& c, const std::string& name, const std::string& token, const std::string& script);
// Creates `name` with the CLI arguments `args` and waits until its agent answers; returns create's JSON.
nlohmann::json create_with_agent(Cluster& c, const std::string& name, const std::string& args);

// SSH clients (docs/ssh.md): two fresh ed25519 identities in <cluster dir>/client-ssh, one to register.
struct SshKeys {
  std::string dir;
  std::string good;  // to be registered
  std::string bad;   // never registered
};
SshKeys make_ssh_keys(Cluster& c);
// ssh, scp or sftp (`program`) with the Host block `sandgate ssh-config` printed (`config`), one identity and
// a known_hosts file of the test's own, never the machine's; `strict` is StrictHostKeyChecking's value.
std::string ssh_client(Cluster& c, const std::string& program, const std::string& config, const std::string& key,
                       const std::string& known_hosts, const std::string& strict = "yes");
// The known_hosts line for `name`, from the host key the node keeps for sandbox `id`: with
// StrictHostKeyChecking=yes it proves the sandbox presents exactly that key.
std::string known_hosts_line(Cluster& c, const std::string& name, const std::string& id);

}  // namespace sg::e2e
