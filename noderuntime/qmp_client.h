// An asynchronous client for QEMU's machine protocol (QMP) on a unix socket, on the node's libuv loop.
//
// QMP is line-delimited JSON: the server greets ({"QMP": {...}}), the client leaves capabilities negotiation
// with qmp_capabilities, then sends {"execute": ..., "arguments": ..., "id": N} and gets {"return": ...,
// "id": N} or {"error": {"class": ..., "desc": ...}, "id": N}; asynchronous {"event": ...} messages may come
// in between. Replies are matched by id, so commands may overlap.
//
// The peer is a VMM that may die at any moment and whose output is not trusted: a message that is not JSON,
// is too long, or is an answer to nothing closes the connection, and every command still waiting fails with
// kUnavailable. Nothing the peer sends can crash the node.
#pragma once

#include <uv.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/error.h"

namespace sg {

struct QmpOptions {
  // How long connect() keeps retrying while the socket does not exist yet or refuses connections (a QEMU
  // spawned a moment ago); 0: fail at once.
  uint32_t connect_wait_ms = 0;
  // Bounds connect() (after the socket accepted: greeting + qmp_capabilities) and each command.
  uint32_t timeout_ms = 5000;
  // One message (one line); QEMU's answers are a few KiB at most (query-migrate, query-status).
  size_t max_message_bytes = 1024 * 1024;
};

class QmpClient {
 public:
  using Reply = std::function<void(Result<nlohmann::json>)>;  // the "return" value
  using EventHandler = std::function<void(const std::string& event, const nlohmann::json& data)>;

  // `peer` names the server in messages ("qemu (sandbox sb-...)").
  QmpClient(uv_loop_t* loop, std::string socket_path, std::string peer, QmpOptions options);
  // Closes the connection; callbacks of commands in flight never run.
  ~QmpClient();
  QmpClient(const QmpClient&) = delete;
  QmpClient& operator=(const QmpClient&) = delete;

  // Connects, reads the greeting and negotiates capabilities. `done` runs once, from the loop.
  void connect(std::function<void(Status)> done);
  // Runs `command` (after connect() succeeded). `done` runs once, from the loop, never before execute()
  // returns: with the "return" value; for an error reply a failure carrying QMP's `desc` (qmp_failure);
  // kTimeout (the connection is closed then: a late answer would be misread); kUnavailable when the
  // connection is gone or closes first.
  void execute(const std::string& command, nlohmann::json arguments, Reply done);
  // Asynchronous events (STOP, RESUME, SHUTDOWN, MIGRATION, ...), in the order they arrive.
  void on_event(EventHandler handler) { on_event_ = std::move(handler); }

 private:
  struct Pending {
    Reply done;
    uv_timer_t* timer = nullptr;
    QmpClient* client = nullptr;
  };

  void try_connect();
  void on_connected(int status);
  void start_reading();
  void on_data(const char* data, size_t len);
  void handle_message(const std::string& line);
  void send_raw(const std::string& line);
  // Closes the connection and fails everything waiting with `why` (kUnavailable unless told otherwise).
  void shut(Failure why);
  void finish_connect(Status s);
  void complete(uint64_t id, Result<nlohmann::json> result);
  void defer(std::function<void()> fn);

  uv_loop_t* loop_;
  std::string socket_path_;
  std::string peer_;
  QmpOptions options_;
  EventHandler on_event_;

  uv_pipe_t* pipe_ = nullptr;           // heap-allocated: freed in its close callback
  uv_connect_t* connect_req_ = nullptr;
  uv_timer_t* timer_ = nullptr;         // connect retries and the connect deadline
  uint64_t connect_started_ms_ = 0;
  std::function<void(Status)> connect_done_;
  bool greeted_ = false;
  bool ready_ = false;
  bool closed_ = false;
  std::string inbuf_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::unique_ptr<Pending>> pending_;
  // Results decided without the peer (no connection) are delivered from the loop through this timer.
  uv_timer_t* deferred_timer_ = nullptr;
  std::vector<std::function<void()>> deferred_;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
};

// Maps a QMP error object ({"class": ..., "desc": ...}) to a Failure naming `what`: GenericError ->
// kInvalidArgument, CommandNotFound -> kUnsupported, DeviceNotActive -> kConflict, anything else -> kInternal.
Failure qmp_failure(std::string_view what, const nlohmann::json& error);

}  // namespace sg
