// Contract-test support for the Firecracker and Cloud Hypervisor drivers: ApiSpec loads a hypervisor's own
// API specification (Swagger 2.0 or OpenAPI 3.0 YAML from ../shared/specs) and validates requests against
// it; FakeHypervisor serves that spec on a unix socket from its own thread, records every request with the
// problems the validator found, and answers with responses the spec defines (success, or an injected error
// status with the body the spec gives it), or injects transport faults (no answer, close mid-response).
//
// Validation rules (a JSON-Schema subset, as the two specs use it): the path exists (path parameters match a
// segment and are declared), the method is defined on it, a required body is present and an operation without
// a body gets none, Content-Type is application/json, and the body validates against the referenced schema
// ($ref and allOf resolved): types, required fields, enum values, minimum/maximum, int16/int32 ranges, array
// items, readOnly fields refused in requests, and — stricter than JSON Schema's default — any field that is
// not in the schema's properties is flagged unless additionalProperties allows it (both hypervisors reject
// unknown fields: Firecracker's and Cloud Hypervisor's request structs deny them). One prose rule of the
// Firecracker spec is enforced as well: SnapshotLoadParams needs exactly one of mem_backend / mem_file_path.
//
// yaml-cpp throws on malformed YAML; that is confined to this test code.
#pragma once

#include <yaml-cpp/yaml.h>

#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <uv.h>

#include <functional>

#include "common/fd.h"
#include "noderuntime/driver.h"
#include "tests/unit/temp_dir.h"

namespace sg::testing {

// ../shared as the build saw it; empty if the directory is missing.
std::string shared_dir();
// ../shared/specs/<file>, or null when the shared directory is missing (the caller skips, loudly).
std::unique_ptr<class ApiSpec> load_spec(const std::string& file);

// A libuv loop for one test; closing it closes whatever handles are left.
class TestLoop {
 public:
  TestLoop() { uv_loop_init(&loop_); }
  ~TestLoop();
  uv_loop_t* get() { return &loop_; }
  // Runs until `done()` holds or `timeout_ms` passes; returns done().
  bool run_until(const std::function<bool()>& done, int timeout_ms = 5000);

 private:
  uv_loop_t loop_;
};

// A stand-in VMM binary: records its pid in <dir of its socket argument>/vmm.pid, makes the API socket path
// it was given (argv[2], as in `firecracker --api-sock PATH`) a symlink to `fake_socket`, and sleeps. So the
// driver really spawns, connects through the path it chose, and kills a process.
std::string write_vmm_script(const std::string& dir, const std::string& fake_socket);
int read_pid_file(const std::string& path);
bool process_alive(int pid);

class ApiSpec {
 public:
  // Throws YAML::Exception on a malformed file.
  explicit ApiSpec(const std::string& path);

  struct Check {
    std::string op_key;  // "PUT /drives/{drive_id}" (path relative to the base path), empty if unmatched
    std::vector<std::string> problems;
  };
  // `content_type` is null when the request had no Content-Type header.
  Check check_request(const std::string& method, const std::string& target, const std::string* content_type,
                      const std::string& body) const;
  // Problems of `value` against `schema` (a node of this spec); `where` prefixes each problem.
  std::vector<std::string> validate(const YAML::Node& schema, const nlohmann::json& value,
                                    const std::string& where) const;

  // Responses of an operation: the lowest 2xx it defines; whether `status` is defined explicitly or through
  // "default"; the body schema for a status (null node if it has none).
  int success_status(const std::string& op_key) const;
  bool defines_status(const std::string& op_key, int status) const;
  YAML::Node response_schema(const std::string& op_key, int status) const;
  // A minimal instance of `schema` that validates against it (required fields only).
  nlohmann::json example(const YAML::Node& schema) const;

  const std::string& base_path() const { return base_path_; }
  std::set<std::string> operations() const;
  // Follows $ref (chains included) to the schema it names.
  YAML::Node resolve(const YAML::Node& node) const;

 private:
  const YAML::Node operation(const std::string& op_key) const;
  YAML::Node response(const std::string& op_key, int status) const;
  void validate_into(const YAML::Node& schema, const nlohmann::json& value, const std::string& where,
                     std::vector<std::string>& out) const;

  YAML::Node root_;
  bool openapi3_ = false;
  std::string base_path_;  // "" for Firecracker ("/"), "/api/v1" for Cloud Hypervisor
};

struct RecordedRequest {
  std::string method;
  std::string target;
  std::string op_key;
  std::string body;
  std::vector<std::string> problems;
};

class FakeHypervisor {
 public:
  enum class Fault { kErrorStatus, kNoAnswer, kCloseMidResponse };

  // Listens on `socket_path` and serves from its own thread until destroyed.
  FakeHypervisor(const ApiSpec& spec, std::string socket_path);
  ~FakeHypervisor();
  FakeHypervisor(const FakeHypervisor&) = delete;
  FakeHypervisor& operator=(const FakeHypervisor&) = delete;

  const std::string& socket_path() const { return socket_path_; }
  // The next request for `op_key` gets `fault`. For kErrorStatus the spec must define `status` for that
  // operation (explicitly or as "default"; the test fails otherwise), and the body is what the spec gives
  // that response: its schema's example with every string field set to `message` (Firecracker's
  // {"fault_message": ...}), or `message` as text when the spec defines no body (Cloud Hypervisor).
  void inject(const std::string& op_key, Fault fault, int status = 0, std::string message = {});
  // Fields merged into the success body of `op_key` (e.g. {"state": "Paused"} for GET /); they are
  // validated against the response schema like everything else.
  void set_response_fields(const std::string& op_key, nlohmann::json fields);
  // Runs `effect` with the request body before a success answer to `op_key` (on the fake's thread): what
  // the hypervisor would do besides answering, e.g. write the snapshot files a request names.
  void on_success(const std::string& op_key, std::function<void(const nlohmann::json&)> effect);

  std::vector<RecordedRequest> requests() const;
  std::vector<std::string> problems() const;  // of every request so far, each prefixed with its request line
  std::set<std::string> operations_seen() const;

 private:
  struct Injected {
    Fault fault;
    int status;
    std::string message;
  };
  void serve();
  void handle(UniqueFd conn);
  std::string respond(const RecordedRequest& req, std::optional<Injected> fault);

  const ApiSpec& spec_;
  std::string socket_path_;
  UniqueFd listen_fd_;
  UniqueFd wake_read_, wake_write_;
  std::vector<UniqueFd> held_;  // connections left unanswered (kNoAnswer), closed on destruction
  mutable std::mutex mu_;
  std::vector<RecordedRequest> requests_;
  std::map<std::string, std::vector<Injected>> faults_;
  std::map<std::string, nlohmann::json> response_fields_;
  std::map<std::string, std::function<void(const nlohmann::json&)>> effects_;
  std::vector<std::string> response_problems_;
  std::thread thread_;
};

// The host side of a hybrid vsock device (Firecracker's protocol, which Cloud Hypervisor implements too): a
// unix socket where a client writes "CONNECT <port>\n" and gets "OK <host port>\n" when the guest listens on
// <port>, or a closed connection when nothing does. Accepted streams echo what they receive.
class FakeVsock {
 public:
  FakeVsock(std::string socket_path, std::set<uint16_t> listening);
  ~FakeVsock();
  FakeVsock(const FakeVsock&) = delete;
  FakeVsock& operator=(const FakeVsock&) = delete;
  std::vector<uint16_t> connects() const;  // the ports asked for, in order

 private:
  void serve();
  std::string socket_path_;
  std::set<uint16_t> listening_;
  UniqueFd listen_fd_;
  UniqueFd wake_read_, wake_write_;
  mutable std::mutex mu_;
  std::vector<uint16_t> connects_;
  std::thread thread_;
};

// The agent path of a VMM driver over its vsock device (what the proxy gets for <name>.<domain>): a guest
// port that listens gives a connected stream that carries bytes; one that does not is kUnreachable with the
// reason; a VMM whose vsock socket is gone is kUnavailable. `info` is what the driver's start() returned.
void expect_agent_path_over_vsock(Driver& driver, const SandboxSpec& spec, const RuntimeInfo& info,
                                  const std::string& vsock_path_sent_to_the_vmm);

// What the node gives a driver for a create from memory snapshot `snap` of `source`: its shape, a new id.
SandboxSpec from_memory_snapshot(const SandboxSpec& source, const std::string& snap);
// driver.checkpoint_memory into `dir` (of a VM suspended in memory: `paused`), the loop run until it answers
// (8 s at most).
Result<VmCheckpoint> checkpoint_memory(Driver& driver, TestLoop& loop, const SandboxSpec& spec,
                                           const RuntimeInfo& info, const std::string& dir,
                                           CheckpointFrom source = CheckpointFrom::kRunning);

}  // namespace sg::testing
