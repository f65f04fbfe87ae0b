#include "tests/e2e/harness.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

namespace sg::e2e {

std::string bin(const std::string& relative) { return std::string(SANDGATE_BIN_DIR) + "/" + relative; }
std::string source(const std::string& relative) { return std::string(SANDGATE_SOURCE_DIR) + "/" + relative; }
std::string tool(const std::string& name) { return std::string(kToolsInSandbox) + "/" + name; }

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') out += "'\\''";
    else out += c;
  }
  return out + "'";
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_file(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << data;
}

namespace {

// One directory per test process for the commands' captured output, so nothing is written to /tmp itself;
// removed when the process exits. Initialised once, also when the first run() comes from another thread.
struct CaptureDir {
  std::string path = "/tmp";  // only if no directory can be made
  bool made = false;
  CaptureDir() {
    char tmpl[] = "/tmp/sg-e2e-run-XXXXXX";
    made = ::mkdtemp(tmpl) != nullptr;
    if (made) path = tmpl;
  }
  ~CaptureDir() {
    std::error_code ec;
    if (made) std::filesystem::remove_all(path, ec);
  }
};

const std::string& capture_dir() {
  static const CaptureDir dir;
  return dir.path;
}

}  // namespace

std::string bearer(const std::string& token) { return "-H " + shell_quote("Authorization: Bearer " + token); }

CommandResult run(const std::string& cmd, int timeout_s) {
  std::string out_path = capture_dir() + "/out-XXXXXX";
  std::string err_path = capture_dir() + "/err-XXXXXX";
  int out_fd = mkstemp(out_path.data());
  int err_fd = mkstemp(err_path.data());
  ::close(out_fd);
  ::close(err_fd);
  std::string full = "timeout -s KILL " + std::to_string(timeout_s) + " sh -c " + shell_quote(cmd) + " >" +
                     out_path + " 2>" + err_path + " </dev/null";
  int status = std::system(full.c_str());
  CommandResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = read_file(out_path);
  r.err = read_file(err_path);
  ::unlink(out_path.c_str());
  ::unlink(err_path.c_str());
  return r;
}

const TestImage& test_image() {
  static const TestImage image = [] {
    TestImage t;
    // tests/run.sh names one directory for both of its passes, so the sanitizer pass reuses the image.
    const char* env = std::getenv("SANDGATE_TEST_IMAGE_DIR");
    const std::string dir = env != nullptr && *env != '\0' ? env : std::string(SANDGATE_BIN_DIR) + "/test-image";
    auto made = run("bash " + shell_quote(source("tests/e2e/tools/make-test-image.sh")) + " " + shell_quote(dir), 900);
    EXPECT_EQ(made.exit_code, 0) << made.err;
    t.archive = made.out.substr(0, made.out.find('\n'));
    // test-image-<key>.tar -> sandgate-test-<key>: a changed image never reuses an old one's name.
    const std::string base = t.archive.substr(t.archive.rfind('/') + 1);
    const std::string prefix = "test-image-", suffix = ".tar";
    // Without an image every create fails naming this one, after the failure above says why.
    t.name = "missing-test-image";
    if (base.size() > prefix.size() + suffix.size() && base.starts_with(prefix) && base.ends_with(suffix))
      t.name = "sandgate-test-" + base.substr(prefix.size(), base.size() - prefix.size() - suffix.size());
    t.store = dir + "/store";
    std::filesystem::create_directories(t.store);
    return t;
  }();
  return image;
}

// Imports the test image through `c`'s node unless the shared store has it; serialized across test
// processes by a lock file next to the store.
void ensure_test_image(Cluster& c) {
  const TestImage& t = test_image();
  const std::string marker = t.store + "/images/" + t.name + ".json";
  struct stat st;
  if (::stat(marker.c_str(), &st) == 0) return;
  int lock = ::open((t.store + "/../.import-lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  ASSERT_GE(lock, 0);
  const bool locked = ::flock(lock, LOCK_EX) == 0;
  EXPECT_TRUE(locked) << std::strerror(errno);
  if (locked && ::stat(marker.c_str(), &st) != 0) {
    auto r = c.cli("image import " + shell_quote(t.archive) + " " + t.name, 600);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  }
  ::close(lock);
}

std::string sha256_file(const std::string& path) {
  auto r = run("sha256sum " + shell_quote(path) + " | cut -d' ' -f1");
  std::string s = r.out;
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

Daemon::~Daemon() {
  if (pid_ > 0) stop(SIGKILL, 5000);
}

bool Daemon::start(const std::vector<std::string>& argv, const std::string& log_path,
                   const std::vector<std::string>& env) {
  log_path_ = log_path;
  pid_t pid = ::fork();
  if (pid < 0) return false;
  if (pid == 0) {
    int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    int devnull = ::open("/dev/null", O_RDONLY);
    ::dup2(devnull, 0);
    for (const std::string& kv : env) ::putenv(const_cast<char*>(kv.c_str()));
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    _exit(127);
  }
  pid_ = pid;
  return true;
}

std::string Daemon::wait_for(const std::string& needle, int timeout_ms, size_t from) {
  std::string line;
  eventually(
      [&] {
        std::string text = log();
        if (text.size() < from) return false;
        auto pos = text.find(needle, from);
        if (pos == std::string::npos) {
          int status;
          if (pid_ > 0 && ::waitpid(pid_, &status, WNOHANG) == pid_) {
            pid_ = -1;
            return true;  // died: give up early, line stays empty
          }
          return false;
        }
        auto start = text.rfind('\n', pos);
        start = start == std::string::npos ? 0 : start + 1;
        auto end = text.find('\n', pos);
        line = text.substr(start, end == std::string::npos ? std::string::npos : end - start);
        return true;
      },
      std::chrono::milliseconds(timeout_ms));
  return line;
}

int Daemon::stop(int sig, int timeout_ms) {
  if (pid_ <= 0) return -1;
  ::kill(pid_, sig);
  int status = -1;
  bool exited = eventually([&] { return ::waitpid(pid_, &status, WNOHANG) == pid_; },
                           std::chrono::milliseconds(timeout_ms));
  if (!exited) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, &status, 0);
  }
  pid_ = -1;
  return status;
}

int Daemon::wait_exit(int timeout_ms) {
  if (pid_ <= 0) return -1;
  int status = -1;
  if (!eventually([&] { return ::waitpid(pid_, &status, WNOHANG) == pid_; }, std::chrono::milliseconds(timeout_ms)))
    return -1;
  pid_ = -1;
  return status;
}

namespace {
std::atomic<int> cluster_counter{0};

uint16_t parse_port(const std::string& ready_line) {
  // "... ready on 127.0.0.1:PORT (..."
  auto on = ready_line.find(" on ");
  if (on == std::string::npos) return 0;
  auto colon = ready_line.find(':', on + 4);
  if (colon == std::string::npos) return 0;
  return static_cast<uint16_t>(std::atoi(ready_line.c_str() + colon + 1));
}
}  // namespace

Cluster::Cluster(ClusterOptions opts) : opts_(std::move(opts)) {
  char tmpl[] = "/tmp/sg-e2e-XXXXXX";
  dir_ = ::mkdtemp(tmpl);
  ::chmod(dir_.c_str(), 0755);
  int n = cluster_counter.fetch_add(1);
  cgroup_name_ = "sgtest-" + std::to_string(::getpid()) + "-" + std::to_string(n);
  api_ = "unix:" + dir_ + "/node.sock";
  ::mkdir(home().c_str(), 0700);
  auto gen = run("bash " + source("deploy/gen-cert.sh") + " " + dir_ + "/tls sandbox.localhost");
  EXPECT_EQ(gen.exit_code, 0) << gen.err;
  ca_ = dir_ + "/tls/ca.pem";
  write_config();
  start_node();
  if (shares_test_image()) ensure_test_image(*this);
  if (opts_.start_proxy) start_proxy();
}

Cluster::~Cluster() {
  stop_proxy();
  stop_node();
  // Anything a failed test left behind: processes in our cgroups, then the cgroups themselves.
  run("for d in /sys/fs/cgroup/*/" + cgroup_name_ + " /sys/fs/cgroup/" + cgroup_name_ +
      "; do [ -d \"$d\" ] || continue; for p in $(cat $d/*/cgroup.procs 2>/dev/null); do kill -9 $p; done; "
      "for f in $d/*/cgroup.freeze; do [ -f $f ] && echo 0 > $f; done; "
      "for f in $d/*/freezer.state; do [ -f $f ] && echo THAWED > $f; done; "
      "sleep 0.2; rmdir $d/* $d 2>/dev/null; done; true");
  if (!::testing::Test::HasFailure()) run("rm -rf " + shell_quote(dir_));
}

void Cluster::write_config() {
  // Known only now: what the node advertises of itself (its socket, in a fleet) lives in this dir.
  std::string node_extra = opts_.node_extra;
  for (size_t at; (at = node_extra.find("$CLUSTER_DIR")) != std::string::npos;) node_extra.replace(at, 12, dir_);
  std::string top = "domain = \"sandbox.localhost\"\nnode_socket = \"" + api_ + "\"\nlog_level = \"debug\"\n";
  if (!opts_.operator_token.empty()) {
    write_file(dir_ + "/operator.token", opts_.operator_token + "\n");
    ::chmod((dir_ + "/operator.token").c_str(), 0600);  // the node refuses a token others can read
    top += "operator_token_file = \"" + dir_ + "/operator.token\"\n";
  }
  std::string cfg = top + "\n" +
                    "[proxy]\nlisten = \"127.0.0.1:0\"\n" +
                    // Two workers unless the test chose: connections then spread over both, as in production.
                    (opts_.proxy_extra.find("workers =") == std::string::npos ? "workers = 2\n" : "") +
                    "access_log = \"" + dir_ +
                    "/access.log\"\n" + opts_.proxy_extra + "\n[[proxy.certificates]]\ncert = \"" + dir_ +
                    "/tls/server.pem\"\nkey = \"" + dir_ + "/tls/server.key\"\n\n[node]\nstate_dir = \"" + dir_ +
                    "/node\"\non_shutdown = \"terminate\"\ncgroup_name = \"" + cgroup_name_ + "\"\ninit_path = \"" +
                    bin("noderuntime/sandgate-init") + "\"\n" +
                    (shares_test_image() ? "images_dir = \"" + test_image().store + "\"\ndefault_image = \"" +
                                               test_image().name + "\"\n"
                                         : std::string()) +
                    node_extra + "\n";
  write_file(config_path(), cfg);
}

void Cluster::start_node(const std::vector<std::string>& env) {
  size_t from = node_.running() ? 0 : read_file(dir_ + "/node.log").size();
  ASSERT_TRUE(node_.start({bin("noderuntime/sandgate-node"), "--config", config_path()}, dir_ + "/node.log", env));
  std::string line = node_.wait_for("sandgate-node ready", 15000, from);
  ASSERT_FALSE(line.empty()) << "node did not start:\n" << node_.log();
}

void Cluster::start_proxy() {
  size_t from = read_file(dir_ + "/proxy.log").size();
  ASSERT_TRUE(proxy_.start({bin("proxy/sandgate-proxy"), "--config", config_path()}, dir_ + "/proxy.log"));
  std::string line = proxy_.wait_for("sandgate-proxy ready", 15000, from);
  ASSERT_FALSE(line.empty()) << "proxy did not start:\n" << proxy_.log();
  port_ = parse_port(line);
  ASSERT_NE(port_, 0) << line;
}

int Cluster::stop_node(int sig) { return node_.stop(sig); }
int Cluster::stop_proxy(int sig) { return proxy_.stop(sig); }

std::string Cluster::sandgate() const {
  // env(1), not "VAR=value cmd": ssh runs a ProxyCommand with "exec", which takes no assignments.
  return "env HOME=" + shell_quote(home()) + " XDG_CONFIG_HOME=" + shell_quote(home() + "/.config") + " " +
         shell_quote(bin("cli/sandgate"));
}

CommandResult Cluster::cli(const std::string& args, int timeout_s) {
  return run(sandgate() + " --api " + shell_quote(api_) + " " + args, timeout_s);
}

nlohmann::json Cluster::create_http_sandbox(const std::string& name, uint16_t port, const std::string& extra_flags) {
  auto r = cli("create --json --name " + name + " --public " + std::to_string(port) + " " + extra_flags +
               " -- /usr/bin/python3 " + tool("testserver.py") + " http " + std::to_string(port) +
               " " + name);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  EXPECT_TRUE(j.is_object()) << r.out;
  return j;
}

nlohmann::json Cluster::get(const std::string& ref) {
  auto r = cli("get --json " + ref);
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  if (r.exit_code != 0 || !j.is_object()) return nlohmann::json::object();
  return j;
}

void Cluster::wait_until_serving(const std::string& name, uint16_t port) {
  std::string host = std::to_string(port) + "-" + name + ".sandbox.localhost";
  bool ok = eventually([&] { return http_code(curl(host, "/", "", 10)) == 200; }, std::chrono::seconds(20));
  ASSERT_TRUE(ok) << "sandbox " << name << " never served on port " << port;
}

std::string Cluster::url(const std::string& host, const std::string& path) const {
  return "https://" + host + ":" + std::to_string(port_) + path;
}

CommandResult Cluster::curl(const std::string& host, const std::string& path, const std::string& extra, int timeout_s) {
  // --resolve pins the name to loopback explicitly (curl maps *.localhost there anyway).
  return run("curl -sS --cacert " + shell_quote(ca_) + " --resolve " + host + ":" + std::to_string(port_) +
                 ":127.0.0.1 -w '\\n%{http_code}' " + extra + " " + shell_quote(url(host, path)),
             timeout_s);
}

int Cluster::http_code(const CommandResult& r) {
  auto nl = r.out.rfind('\n');
  return std::atoi(r.out.c_str() + (nl == std::string::npos ? 0 : nl + 1));
}

std::string Cluster::body(const CommandResult& r) {
  auto nl = r.out.rfind('\n');
  std::string b = nl == std::string::npos ? std::string() : r.out.substr(0, nl);
  while (!b.empty() && (b.back() == '\n' || b.back() == '\r')) b.pop_back();
  return b;
}

CommandResult Cluster::api_raw(const std::string& method, const std::string& path, const std::string& body) {
  return run("curl -sS --unix-socket " + shell_quote(api_.substr(5)) + " -X " + method +
             " -H 'Content-Type: application/json' --data-binary " + shell_quote(body) +
             " -w '\\n%{http_code}' http://node" + path);
}

std::string Cluster::create_private_serving(const std::string& name, const std::string& create_options) {
  auto r = cli("create --json --name " + name + " " + create_options + " --expose 8080 -- /usr/bin/python3 " + tool("testserver.py") +
               " http 8080 " + name);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  if (!j.is_object() || !j.contains("token")) {
    ADD_FAILURE() << r.out;
    return {};
  }
  std::string token = j["token"].get<std::string>();
  std::string host = "8080-" + name + ".sandbox.localhost";
  EXPECT_TRUE(eventually([&] { return http_code(curl(host, "/", bearer(token), 10)) == 200; },
                         std::chrono::seconds(20)));
  return token;
}

size_t Cluster::node_calls(const std::string& path) {
  std::string log = node_.log();
  // The log line is "<peer> <method> <path> -> <status>": the trailing space keeps /open from matching /open2.
  const std::string needle = " " + path + " ";
  size_t n = 0;
  for (size_t at = log.find(needle); at != std::string::npos; at = log.find(needle, at + 1)) ++n;
  return n;
}

std::vector<nlohmann::json> Cluster::access_log() const {
  std::vector<nlohmann::json> out;
  std::string text = read_file(dir_ + "/access.log");
  // A line the proxy is still writing has no newline yet (a reader can see a write cut at a page boundary):
  // it is left for the next read. A finished line that is not a JSON object is a defect.
  text.resize(text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1);
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object()) {
      out.push_back(std::move(j));
    } else {
      ADD_FAILURE() << "access log line is not a JSON object: " << line;
    }
  }
  return out;
}

uint16_t Cluster::metrics_port() {
  std::smatch m;
  std::string log;
  EXPECT_TRUE(eventually([&] {
    log = proxy().log();
    static const std::regex re(R"(metrics on http://127\.0\.0\.1:(\d+)/metrics)");
    return std::regex_search(log, m, re);
  }, std::chrono::seconds(10))) << log;
  return m.empty() ? 0 : static_cast<uint16_t>(std::stoi(m[1].str()));
}

nlohmann::json Cluster::wait_access_entry(const std::function<bool(const nlohmann::json&)>& pred, int timeout_ms) {
  nlohmann::json found;
  eventually(
      [&] {
        for (auto& e : access_log())
          if (pred(e)) {
            found = e;
            return true;
          }
        return false;
      },
      std::chrono::milliseconds(timeout_ms));
  return found;
}

bool Cluster::cgroup_frozen(const std::string& id) const {
  std::string events = read_file("/sys/fs/cgroup/unified/" + cgroup_name_ + "/" + id + "/cgroup.events");
  if (events.empty()) events = read_file("/sys/fs/cgroup/" + cgroup_name_ + "/" + id + "/cgroup.events");
  if (!events.empty()) return events.find("frozen 1") != std::string::npos;
  std::string state = read_file("/sys/fs/cgroup/freezer/" + cgroup_name_ + "/" + id + "/freezer.state");
  return state.find("FROZEN") != std::string::npos;
}

bool Cluster::cgroup_exists(const std::string& id) const {
  struct stat st;
  for (const std::string& root : {std::string("/sys/fs/cgroup/unified/"), std::string("/sys/fs/cgroup/freezer/"),
                                  std::string("/sys/fs/cgroup/memory/"), std::string("/sys/fs/cgroup/")})
    if (::stat((root + cgroup_name_ + "/" + id).c_str(), &st) == 0) return true;
  return false;
}

Exec exec_in(Cluster& c, const std::string& name, const std::string& token, const std::vector<std::string>& command,
             const std::string& stdin_text) {
  nlohmann::json body = {{"command", command}, {"timeout_secs", 60}};
  if (!stdin_text.empty()) body["stdin"] = stdin_text;
  auto r = c.curl(name + ".sandbox.localhost", "/exec",
                  "-X POST -H 'Content-Type: application/json' --data " + shell_quote(body.dump()) + " " +
                      bearer(token),
                  90);
  Exec e;
  std::istringstream lines(Cluster::body(r));
  std::string line;
  while (std::getline(lines, line)) {
    auto ev = nlohmann::json::parse(line, nullptr, false);
    if (!ev.is_object()) continue;
    if (ev.value("type", "") == "exit") e.code = ev.value("code", -1);
    if (ev.contains("data")) e.out += ev["data"].get<std::string>();
  }
  if (e.code == -1) e.out += "\n[no exit event] " + r.out + r.err;
  return e;
}

Exec sh(Cluster& c, const std::string& name, const std::string& token, const std::string& script) {
  return exec_in(c, name, token, {"/bin/sh", "-c", script});
}

nlohmann::json create_with_agent(Cluster& c, const std::string& name, const std::string& args) {
  auto r = c.cli("create --json --name " + name + " " + args);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  if (!j.is_object() || !j.contains("token")) return nlohmann::json::object();
  std::string token = j["token"];
  EXPECT_TRUE(eventually(
      [&] { return Cluster::http_code(c.curl(name + ".sandbox.localhost", "/health", bearer(token), 10)) == 200; },
      std::chrono::seconds(20)))
      << name << "'s agent never answered";
  return j;
}

SshKeys make_ssh_keys(Cluster& c) {
  SshKeys k{c.dir() + "/client-ssh", c.dir() + "/client-ssh/id_good", c.dir() + "/client-ssh/id_bad"};
  ::mkdir(k.dir.c_str(), 0700);
  for (const std::string& key : {k.good, k.bad})
    EXPECT_EQ(run("ssh-keygen -q -t ed25519 -N '' -C test-key -f " + shell_quote(key)).exit_code, 0);
  return k;
}

std::string ssh_client(Cluster& c, const std::string& program, const std::string& config, const std::string& key,
                       const std::string& known_hosts, const std::string& strict) {
  return "env HOME=" + shell_quote(c.home()) + " XDG_CONFIG_HOME=" + shell_quote(c.home() + "/.config") + " " +
         program + " -F " + shell_quote(config) + " -i " + shell_quote(key) +
         " -o IdentitiesOnly=yes -o IdentityAgent=none -o BatchMode=yes -o LogLevel=ERROR" +
         " -o UserKnownHostsFile=" + shell_quote(known_hosts) + " -o StrictHostKeyChecking=" + strict;
}

std::string known_hosts_line(Cluster& c, const std::string& name, const std::string& id) {
  auto pub = run("ssh-keygen -y -f " + shell_quote(c.dir() + "/node/sandboxes/" + id + "/ssh/host_ed25519"));
  EXPECT_EQ(pub.exit_code, 0) << pub.err;
  return name + ".sandbox.localhost " + pub.out;
}

}  // namespace sg::e2e
