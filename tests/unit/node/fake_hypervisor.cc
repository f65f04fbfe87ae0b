#include "tests/unit/node/fake_hypervisor.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <sys/stat.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <fstream>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "common/http.h"
#include "noderuntime/hypervisor_client.h"
#include "snapshot/snapshot_store.h"

namespace sg::testing {
namespace {

using json = nlohmann::json;

std::vector<std::string> split_path(const std::string& p) {
  std::vector<std::string> out;
  std::stringstream ss(p);
  std::string seg;
  while (std::getline(ss, seg, '/')) {
    if (!seg.empty()) out.push_back(seg);
  }
  return out;
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string json_type(const json& v) {
  if (v.is_object()) return "object";
  if (v.is_array()) return "array";
  if (v.is_string()) return "string";
  if (v.is_boolean()) return "boolean";
  if (v.is_number_integer()) return "integer";
  if (v.is_number()) return "number";
  return "null";
}

bool scalar_equals(const YAML::Node& scalar, const json& v) {
  const std::string& s = scalar.Scalar();
  if (v.is_string()) return v.get<std::string>() == s;
  if (v.is_boolean()) return (v.get<bool>() ? "true" : "false") == s;
  if (v.is_number()) return v.dump() == s;
  return false;
}

}  // namespace

std::string shared_dir() {
#ifdef SANDGATE_SHARED_DIR
  std::error_code ec;
  if (std::filesystem::is_directory(SANDGATE_SHARED_DIR "/specs", ec)) return SANDGATE_SHARED_DIR;
#endif
  return {};
}

std::unique_ptr<ApiSpec> load_spec(const std::string& file) {
  std::string dir = shared_dir();
  if (dir.empty()) {
    std::fprintf(stderr,
                 "\n*** SKIPPING hypervisor contract tests: ../shared/specs is missing next to the source tree. ***\n"
                 "*** The Firecracker / Cloud Hypervisor drivers are NOT verified in this run.             ***\n\n");
    return nullptr;
  }
  return std::make_unique<ApiSpec>(dir + "/specs/" + file);
}

TestLoop::~TestLoop() {
  uv_walk(&loop_, [](uv_handle_t* h, void*) {
    if (!uv_is_closing(h)) uv_close(h, nullptr);
  }, nullptr);
  uv_run(&loop_, UV_RUN_DEFAULT);
  EXPECT_EQ(uv_loop_close(&loop_), 0);
}

bool TestLoop::run_until(const std::function<bool()>& done, int timeout_ms) {
  uv_timer_t tick;
  uv_timer_init(&loop_, &tick);
  uv_timer_start(&tick, [](uv_timer_t*) {}, 2, 2);  // keeps each turn short
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  bool ok = done();
  while (!ok && std::chrono::steady_clock::now() < deadline) {
    uv_run(&loop_, UV_RUN_ONCE);
    ok = done();
  }
  uv_close(reinterpret_cast<uv_handle_t*>(&tick), nullptr);
  uv_run(&loop_, UV_RUN_NOWAIT);
  return ok;
}

std::string write_vmm_script(const std::string& dir, const std::string& fake_socket) {
  std::string path = dir + "/fake-vmm";
  std::ofstream out(path);
  out << "#!/bin/sh\n"
      << "echo $$ > \"$(dirname \"$2\")/vmm.pid\"\n"
      << "ln -sf '" << fake_socket << "' \"$2\"\n"
      << "exec sleep 600\n";
  out.close();
  ::chmod(path.c_str(), 0755);
  return path;
}

int read_pid_file(const std::string& path) {
  std::ifstream in(path);
  int pid = 0;
  in >> pid;
  return pid;
}

bool process_alive(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (pid <= 0 || !std::getline(in, line)) return false;
  size_t close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && line[close + 2] != 'Z';
}

// ---- ApiSpec ----

ApiSpec::ApiSpec(const std::string& path) : root_(YAML::LoadFile(path)) {
  const YAML::Node& root = root_;
  openapi3_ = root["openapi"].IsDefined();
  if (openapi3_) {
    // servers[0].url, e.g. http://localhost/api/v1: its path is the prefix of every request target.
    std::string url = root["servers"][0]["url"].as<std::string>();
    size_t scheme = url.find("://");
    size_t slash = url.find('/', scheme == std::string::npos ? 0 : scheme + 3);
    base_path_ = slash == std::string::npos ? "" : url.substr(slash);
  } else {
    base_path_ = root["basePath"] ? root["basePath"].as<std::string>() : "";
  }
  while (!base_path_.empty() && base_path_.back() == '/') base_path_.pop_back();
}

// yaml-cpp pitfalls handled throughout: Node::operator= writes through to the node it refers to (reset()
// rebinds), and the non-const operator[] inserts missing keys into the shared tree, so every lookup goes
// through const nodes.
YAML::Node ApiSpec::resolve(const YAML::Node& in) const {
  YAML::Node node;
  node.reset(in);
  for (int depth = 0; node.IsMap() && static_cast<const YAML::Node&>(node)["$ref"] && depth < 32; ++depth) {
    std::string ref = static_cast<const YAML::Node&>(node)["$ref"].as<std::string>();
    if (ref.rfind("#/", 0) != 0) throw std::runtime_error("unsupported $ref " + ref);
    YAML::Node cur;
    cur.reset(root_);
    for (const std::string& part : split_path(ref.substr(1))) {
      const YAML::Node& c = cur;
      YAML::Node next = c[part];
      cur.reset(next);
    }
    if (!cur.IsDefined()) throw std::runtime_error("dangling $ref " + ref);
    node.reset(cur);
  }
  return node;
}

std::set<std::string> ApiSpec::operations() const {
  std::set<std::string> out;
  for (const auto& path : root_["paths"]) {
    for (const auto& method : path.second) {
      std::string m = method.first.as<std::string>();
      if (m == "parameters") continue;
      for (char& c : m) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      out.insert(m + " " + path.first.as<std::string>());
    }
  }
  return out;
}

const YAML::Node ApiSpec::operation(const std::string& op_key) const {
  size_t sp = op_key.find(' ');
  return root_["paths"][op_key.substr(sp + 1)][lower(op_key.substr(0, sp))];
}

ApiSpec::Check ApiSpec::check_request(const std::string& method, const std::string& target,
                                      const std::string* content_type, const std::string& body) const {
  Check c;
  std::string path = target.substr(0, target.find('?'));
  if (path.rfind(base_path_ + "/", 0) != 0) {
    c.problems.push_back("target " + target + " is outside the base path '" + base_path_ + "'");
    return c;
  }
  path = path.substr(base_path_.size());
  const std::vector<std::string> segs = split_path(path);

  // Find the path item: literal segments must be equal, {param} segments match any one segment.
  std::string matched;
  std::map<std::string, std::string> params;
  for (const auto& item : root_["paths"]) {
    std::string tmpl = item.first.as<std::string>();
    std::vector<std::string> t = split_path(tmpl);
    if (t.size() != segs.size()) continue;
    std::map<std::string, std::string> p;
    bool ok = true;
    for (size_t i = 0; i < t.size() && ok; ++i) {
      if (t[i].size() > 2 && t[i].front() == '{' && t[i].back() == '}')
        p[t[i].substr(1, t[i].size() - 2)] = segs[i];
      else
        ok = t[i] == segs[i];
    }
    // A literal match beats a templated one (as OpenAPI path matching requires).
    if (ok && (matched.empty() || p.empty())) {
      matched = tmpl;
      params = p;
    }
  }
  if (matched.empty()) {
    c.problems.push_back("path " + path + " is not in the spec");
    return c;
  }
  const YAML::Node op = root_["paths"][matched][lower(method)];
  if (!op.IsDefined()) {
    c.problems.push_back("method " + method + " is not defined for " + matched);
    return c;
  }
  c.op_key = method + " " + matched;

  // Path parameters must be declared (Swagger: parameters with in: path), with their type.
  YAML::Node body_schema;
  bool body_required = false;
  bool takes_body = false;
  std::set<std::string> declared;
  if (op["parameters"]) {
    for (const auto& prm : op["parameters"]) {
      const YAML::Node p = resolve(prm);
      std::string in = p["in"].as<std::string>();
      if (in == "path") {
        declared.insert(p["name"].as<std::string>());
        std::string type = p["type"] ? p["type"].as<std::string>()
                                     : (p["schema"] && p["schema"]["type"] ? p["schema"]["type"].as<std::string>() : "");
        if (type != "string" && !type.empty()) c.problems.push_back("path parameter " + p["name"].as<std::string>() +
                                                                    " has type " + type + ", unsupported by this test");
      } else if (in == "body") {
        takes_body = true;
        body_schema.reset(p["schema"]);
        body_required = p["required"] && p["required"].as<bool>();
      }
    }
  }
  if (openapi3_ && op["requestBody"]) {
    takes_body = true;
    const YAML::Node rb = resolve(op["requestBody"]);
    body_required = rb["required"] && rb["required"].as<bool>();
    body_schema.reset(rb["content"]["application/json"]["schema"]);
    if (!body_schema.IsDefined()) c.problems.push_back(c.op_key + ": the spec has no application/json body");
  }
  for (const auto& [name, value] : params) {
    if (!declared.count(name) && !openapi3_) c.problems.push_back("path parameter {" + name + "} is not declared");
    if (value.empty()) c.problems.push_back("path parameter {" + name + "} is empty");
  }

  if (body.empty()) {
    if (body_required) c.problems.push_back(c.op_key + ": the request body is required");
    return c;
  }
  if (!takes_body) {
    c.problems.push_back(c.op_key + ": the operation takes no request body, got " + std::to_string(body.size()) +
                         " bytes");
    return c;
  }
  if (content_type == nullptr || lower(*content_type).rfind("application/json", 0) != 0)
    c.problems.push_back(c.op_key + ": Content-Type must be application/json, got '" +
                         (content_type ? *content_type : std::string("(none)")) + "'");
  json value = json::parse(body, nullptr, false);
  if (value.is_discarded()) {
    c.problems.push_back(c.op_key + ": the body is not JSON");
    return c;
  }
  for (std::string& p : validate(body_schema, value, "body")) c.problems.push_back(c.op_key + ": " + p);
  // The one constraint the Firecracker spec states only in prose (SnapshotLoadParams' description).
  if (!openapi3_ && matched == "/snapshot/load" && value.is_object() &&
      value.contains("mem_backend") == value.contains("mem_file_path"))
    c.problems.push_back(c.op_key + ": exactly one of mem_backend / mem_file_path must be present");
  return c;
}

std::vector<std::string> ApiSpec::validate(const YAML::Node& schema, const json& value, const std::string& where) const {
  std::vector<std::string> out;
  validate_into(schema, value, where, out);
  return out;
}

void ApiSpec::validate_into(const YAML::Node& schema_in, const json& value, const std::string& where,
                            std::vector<std::string>& out) const {
  const YAML::Node schema = resolve(schema_in);
  if (!schema.IsDefined() || schema.IsNull()) return;  // no schema: anything goes

  // allOf: every part applies; for the unknown-field rule the parts' properties count together.
  std::vector<YAML::Node> parts{schema};
  if (schema["allOf"]) {
    for (const auto& sub : schema["allOf"]) parts.push_back(resolve(sub));
  }
  std::string type;
  for (const auto& p : parts) {
    if (p["type"]) type = p["type"].as<std::string>();
  }
  bool has_props = false;
  for (const auto& p : parts) has_props = has_props || p["properties"];
  if (type.empty() && has_props) type = "object";

  if (!type.empty()) {
    std::string actual = json_type(value);
    bool ok = actual == type || (type == "number" && actual == "integer");
    if (!ok) {
      out.push_back(where + ": expected " + type + ", got " + actual + " " + value.dump());
      return;
    }
  }
  for (const auto& p : parts) {
    if (p["enum"]) {
      bool found = false;
      for (const auto& e : p["enum"]) found = found || scalar_equals(e, value);
      if (!found) out.push_back(where + ": " + value.dump() + " is not one of the enum values");
    }
    if (value.is_number()) {
      if (p["minimum"] && value.get<double>() < p["minimum"].as<double>())
        out.push_back(where + ": " + value.dump() + " is below the minimum " + p["minimum"].Scalar());
      if (p["maximum"] && value.get<double>() > p["maximum"].as<double>())
        out.push_back(where + ": " + value.dump() + " is above the maximum " + p["maximum"].Scalar());
      if (p["format"] && value.is_number_integer()) {
        std::string f = p["format"].as<std::string>();
        long long lim = f == "int16" ? 32767 : f == "int32" ? INT_MAX : 0;
        if (lim != 0 && (value.get<long long>() > lim || value.get<long long>() < -lim - 1))
          out.push_back(where + ": " + value.dump() + " does not fit " + f);
      }
    }
  }
  if (value.is_array()) {
    for (const auto& p : parts) {
      if (!p["items"]) continue;
      for (size_t i = 0; i < value.size(); ++i) validate_into(p["items"], value[i], where + "[" + std::to_string(i) + "]", out);
    }
  }
  if (!value.is_object()) return;

  std::map<std::string, YAML::Node> props;
  std::optional<YAML::Node> additional;
  for (const auto& p : parts) {
    if (p["properties"]) {
      for (const auto& kv : p["properties"]) {
        props.erase(kv.first.as<std::string>());
        props.emplace(kv.first.as<std::string>(), kv.second);
      }
    }
    if (p["required"]) {
      for (const auto& r : p["required"]) {
        if (!value.contains(r.as<std::string>())) out.push_back(where + ": required field '" + r.as<std::string>() + "' is missing");
      }
    }
    if (p["additionalProperties"]) {
      additional.reset();
      additional.emplace(p["additionalProperties"]);
    }
  }
  for (const auto& [key, v] : value.items()) {
    auto it = props.find(key);
    if (it != props.end()) {
      const YAML::Node& ps = it->second;
      if (ps["readOnly"] && ps["readOnly"].as<bool>()) out.push_back(where + "." + key + ": readOnly field sent in a request");
      validate_into(ps, v, where + "." + key, out);
      continue;
    }
    if (additional && additional->IsScalar()) {
      if (additional->as<bool>()) continue;
    } else if (additional) {
      validate_into(*additional, v, where + "." + key, out);
      continue;
    }
    out.push_back(where + ": unknown field '" + key + "' (not in the schema's properties)");
  }
}

// "Not there" is an Undefined node: a default-constructed YAML::Node is a defined Null.
static const YAML::Node kAbsent(YAML::NodeType::Undefined);

YAML::Node ApiSpec::response(const std::string& op_key, int status) const {
  const YAML::Node rs = operation(op_key)["responses"];
  if (!rs.IsDefined()) return kAbsent;
  for (const auto& kv : rs) {
    if (kv.first.as<std::string>() == std::to_string(status)) return resolve(kv.second);
  }
  return rs["default"] ? resolve(rs["default"]) : kAbsent;
}

int ApiSpec::success_status(const std::string& op_key) const {
  int best = 0;
  for (const auto& kv : operation(op_key)["responses"]) {
    std::string k = kv.first.as<std::string>();
    if (k.size() == 3 && k[0] == '2' && (best == 0 || std::stoi(k) < best)) best = std::stoi(k);
  }
  return best;
}

bool ApiSpec::defines_status(const std::string& op_key, int status) const {
  return response(op_key, status).IsDefined();
}

YAML::Node ApiSpec::response_schema(const std::string& op_key, int status) const {
  const YAML::Node r = response(op_key, status);
  if (!r.IsDefined()) return kAbsent;
  if (openapi3_) return r["content"] ? YAML::Node(r["content"]["application/json"]["schema"]) : kAbsent;
  return r["schema"] ? YAML::Node(r["schema"]) : kAbsent;
}

json ApiSpec::example(const YAML::Node& schema_in) const {
  const YAML::Node s = resolve(schema_in);
  if (!s.IsDefined()) return nullptr;
  if (s["enum"]) return s["enum"][0].as<std::string>();
  std::string type = s["type"] ? s["type"].as<std::string>() : (s["properties"] ? "object" : "");
  if (type == "string") return "fake";
  if (type == "integer" || type == "number") return s["minimum"] ? s["minimum"].as<long long>() : 0;
  if (type == "boolean") return false;
  if (type == "array") return json::array();
  json obj = json::object();
  if (s["required"]) {
    for (const auto& r : s["required"]) obj[r.as<std::string>()] = example(s["properties"][r.as<std::string>()]);
  }
  return obj;
}

// ---- FakeHypervisor ----

FakeHypervisor::FakeHypervisor(const ApiSpec& spec, std::string socket_path)
    : spec_(spec), socket_path_(std::move(socket_path)) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, socket_path_.c_str(), sizeof addr.sun_path - 1);
  ::unlink(socket_path_.c_str());
  listen_fd_.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  EXPECT_EQ(::bind(listen_fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0) << std::strerror(errno);
  EXPECT_EQ(::listen(listen_fd_.get(), 16), 0);
  int p[2];
  EXPECT_EQ(::pipe2(p, O_CLOEXEC), 0);
  wake_read_.reset(p[0]);
  wake_write_.reset(p[1]);
  thread_ = std::thread([this] { serve(); });
}

FakeVsock::FakeVsock(std::string socket_path, std::set<uint16_t> listening)
    : socket_path_(std::move(socket_path)), listening_(std::move(listening)) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, socket_path_.c_str(), sizeof addr.sun_path - 1);
  listen_fd_ = UniqueFd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ::unlink(socket_path_.c_str());
  EXPECT_EQ(::bind(listen_fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0) << std::strerror(errno);
  EXPECT_EQ(::listen(listen_fd_.get(), 16), 0);
  int p[2];
  EXPECT_EQ(::pipe2(p, O_CLOEXEC), 0);
  wake_read_ = UniqueFd(p[0]);
  wake_write_ = UniqueFd(p[1]);
  thread_ = std::thread([this] { serve(); });
}

FakeVsock::~FakeVsock() {
  (void)!::write(wake_write_.get(), "x", 1);
  thread_.join();
  ::unlink(socket_path_.c_str());
}

std::vector<uint16_t> FakeVsock::connects() const {
  std::lock_guard lock(mu_);
  return connects_;
}

void FakeVsock::serve() {
  std::vector<UniqueFd> streams;
  while (true) {
    std::vector<pollfd> fds = {{wake_read_.get(), POLLIN, 0}, {listen_fd_.get(), POLLIN, 0}};
    for (const auto& s : streams) fds.push_back({s.get(), POLLIN, 0});
    if (::poll(fds.data(), fds.size(), 5000) <= 0 || (fds[0].revents & POLLIN)) return;
    for (size_t i = 2; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP))) continue;
      char buf[4096];
      ssize_t n = ::recv(fds[i].fd, buf, sizeof buf, 0);
      if (n > 0) (void)!::send(fds[i].fd, buf, static_cast<size_t>(n), MSG_NOSIGNAL);
    }
    if (!(fds[1].revents & POLLIN)) continue;
    UniqueFd conn(::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!conn.valid()) continue;
    std::string line;
    char c = 0;
    while (line.size() < 64 && ::recv(conn.get(), &c, 1, 0) == 1 && c != '\n') line += c;
    uint16_t port = line.rfind("CONNECT ", 0) == 0 ? static_cast<uint16_t>(std::atoi(line.c_str() + 8)) : 0;
    {
      std::lock_guard lock(mu_);
      connects_.push_back(port);
    }
    if (!listening_.count(port)) continue;  // conn closes: what the VMM does when the guest refuses
    const std::string ok = "OK 1073741824\n";
    (void)!::send(conn.get(), ok.data(), ok.size(), MSG_NOSIGNAL);
    streams.push_back(std::move(conn));
  }
}

SandboxSpec from_memory_snapshot(const SandboxSpec& source, const std::string& snap) {
  SandboxSpec out = source;
  out.id = "sb-forkforkfork";
  out.memory_snapshot_dir = snap;
  return out;
}

Result<VmCheckpoint> checkpoint_memory(Driver& driver, TestLoop& loop, const SandboxSpec& spec,
                                           const RuntimeInfo& info, const std::string& dir,
                                           CheckpointFrom source) {
  std::optional<Result<VmCheckpoint>> saved;
  driver.checkpoint_memory(spec, info, CheckpointFiles{.id = snapshot::generate_snapshot_id(), .dir = dir, .final_dir = dir},
                           source, [&](Result<VmCheckpoint> r) { saved = std::move(r); });
  if (!loop.run_until([&] { return saved.has_value(); }, 8000)) return fail(Error::kTimeout, "no answer");
  return *saved;
}

void expect_agent_path_over_vsock(Driver& driver, const SandboxSpec& spec, const RuntimeInfo& info,
                                  const std::string& vsock_path_sent_to_the_vmm) {
  constexpr uint16_t kAgentPort = 9501;
  auto it = info.driver_data.find(VmmDriver::kVsockSocket);
  ASSERT_NE(it, info.driver_data.end()) << "the driver keeps no vsock socket path";
  EXPECT_EQ(it->second, vsock_path_sent_to_the_vmm) << "the driver connects where it did not tell the VMM to listen";
  {
    FakeVsock vsock(it->second, {kAgentPort});
    auto agent = driver.open_socket(spec, info, kAgentPort);
    ASSERT_TRUE(agent.ok()) << agent.message();
    EXPECT_TRUE(agent->connected) << "a vsock stream is handed over connected";
    ASSERT_EQ(::send(agent->fd.get(), "ping", 4, MSG_NOSIGNAL), 4);
    pollfd pfd{agent->fd.get(), POLLIN, 0};
    ASSERT_EQ(::poll(&pfd, 1, 2000), 1);
    char buf[8] = {};
    EXPECT_EQ(::recv(agent->fd.get(), buf, sizeof buf, 0), 4);
    EXPECT_EQ(std::string(buf), "ping") << "the OK line must not be left in the stream";

    auto refused = driver.open_socket(spec, info, 8080);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.error(), Error::kUnreachable);
    EXPECT_NE(refused.message().find("8080 refused"), std::string::npos) << refused.message();
    EXPECT_EQ(vsock.connects(), (std::vector<uint16_t>{kAgentPort, 8080}));
  }
  auto gone = driver.open_socket(spec, info, kAgentPort);
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.error(), Error::kUnavailable);
}

FakeHypervisor::~FakeHypervisor() {
  (void)!::write(wake_write_.get(), "x", 1);
  thread_.join();
  ::unlink(socket_path_.c_str());
}

void FakeHypervisor::inject(const std::string& op_key, Fault fault, int status, std::string message) {
  if (fault == Fault::kErrorStatus) {
    EXPECT_TRUE(spec_.defines_status(op_key, status)) << op_key << " defines no response " << status
                                                      << " in the spec: the fault would not be realistic";
  }
  std::lock_guard lock(mu_);
  faults_[op_key].push_back({fault, status, std::move(message)});
}

void FakeHypervisor::on_success(const std::string& op_key, std::function<void(const json&)> effect) {
  std::lock_guard lock(mu_);
  effects_[op_key] = std::move(effect);
}

void FakeHypervisor::set_response_fields(const std::string& op_key, json fields) {
  std::lock_guard lock(mu_);
  response_fields_[op_key] = std::move(fields);
}

std::vector<RecordedRequest> FakeHypervisor::requests() const {
  std::lock_guard lock(mu_);
  return requests_;
}

std::vector<std::string> FakeHypervisor::problems() const {
  std::lock_guard lock(mu_);
  std::vector<std::string> out = response_problems_;
  for (const auto& r : requests_) {
    for (const auto& p : r.problems) out.push_back(r.method + " " + r.target + " " + r.body + ": " + p);
  }
  return out;
}

std::set<std::string> FakeHypervisor::operations_seen() const {
  std::lock_guard lock(mu_);
  std::set<std::string> out;
  for (const auto& r : requests_) {
    if (!r.op_key.empty()) out.insert(r.op_key);
  }
  return out;
}

void FakeHypervisor::serve() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_.get(), POLLIN, 0}, {wake_read_.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) continue;
    if (fds[1].revents) return;
    UniqueFd conn(::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (conn.valid()) handle(std::move(conn));
  }
}

void FakeHypervisor::handle(UniqueFd conn) {
  HttpParser parser(HttpParser::Kind::kRequest, HttpLimits{16 * 1024, 1024 * 1024, false});
  HttpParser::State st = HttpParser::State::kNeedMore;
  char buf[4096];
  while (st == HttpParser::State::kNeedMore) {
    pollfd pfd{conn.get(), POLLIN, 0};
    if (::poll(&pfd, 1, 2000) <= 0) return;
    ssize_t n = ::recv(conn.get(), buf, sizeof buf, 0);
    if (n <= 0) return;
    st = parser.feed(buf, static_cast<size_t>(n));
  }
  RecordedRequest req;
  if (st == HttpParser::State::kError) {
    req.problems.push_back("unparseable HTTP request: " + parser.failure().message);
  } else {
    const HttpMessage& m = parser.message();
    req.method = m.method;
    req.target = m.target;
    req.body = m.body;
    ApiSpec::Check c = spec_.check_request(m.method, m.target, m.header("Content-Type"), m.body);
    req.op_key = c.op_key;
    req.problems = std::move(c.problems);
  }
  std::optional<Injected> fault;
  {
    std::lock_guard lock(mu_);
    auto it = faults_.find(req.op_key);
    if (it != faults_.end() && !it->second.empty()) {
      fault = it->second.front();
      it->second.erase(it->second.begin());
    }
    requests_.push_back(req);
  }
  if (fault && fault->fault == Fault::kNoAnswer) {
    held_.push_back(std::move(conn));
    return;
  }
  std::string wire = respond(req, fault);
  if (fault && fault->fault == Fault::kCloseMidResponse) wire.resize(wire.size() / 2);
  (void)!::send(conn.get(), wire.data(), wire.size(), MSG_NOSIGNAL);
}

std::string FakeHypervisor::respond(const RecordedRequest& req, std::optional<Injected> fault) {
  int status = 0;
  std::string body;
  std::string content_type = "application/json";
  if (req.op_key.empty() || !req.problems.empty()) {
    // What either hypervisor does with a request it cannot route or parse: a 400 with an error text.
    status = 400;
    body = json{{"fault_message", "fake hypervisor: request violates the spec"}}.dump();
  } else if (fault) {
    status = fault->status;
    const YAML::Node schema = spec_.response_schema(req.op_key, status);
    if (schema.IsDefined()) {
      json b = spec_.example(schema);
      json filled = json::object();
      // Every string property carries the message (Firecracker's Error has one: fault_message).
      const YAML::Node resolved = spec_.resolve(schema);
      for (const auto& kv : resolved["properties"]) {
        if (kv.second["type"] && kv.second["type"].as<std::string>() == "string") filled[kv.first.as<std::string>()] = fault->message;
      }
      b.update(filled);
      body = b.dump();
    } else {
      body = fault->message;
      content_type = "text/plain";
    }
  } else {
    status = spec_.success_status(req.op_key);
    std::function<void(const json&)> effect;
    {
      std::lock_guard lock(mu_);
      auto it = effects_.find(req.op_key);
      if (it != effects_.end()) effect = it->second;
    }
    if (effect) effect(json::parse(req.body.empty() ? "{}" : req.body, nullptr, false));
    const YAML::Node schema = spec_.response_schema(req.op_key, status);
    if (schema.IsDefined()) {
      json b = spec_.example(schema);
      std::lock_guard lock(mu_);
      auto it = response_fields_.find(req.op_key);
      if (it != response_fields_.end()) b.update(it->second);
      for (auto& p : spec_.validate(schema, b, "response")) response_problems_.push_back(req.op_key + ": " + p);
      body = b.dump();
    }
  }
  std::string wire = "HTTP/1.1 " + std::to_string(status) + " " + std::string(http_reason(status)) + "\r\n";
  if (status != 204) {
    wire += "Content-Type: " + content_type + "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  } else {
    body.clear();
  }
  wire += "Connection: close\r\n\r\n" + body;
  return wire;
}

}  // namespace sg::testing
