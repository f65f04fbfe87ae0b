// A blocking client of etcd's v3 API through its gRPC gateway (JSON over HTTP/1.1: POST /v3/kv/range, ...,
// keys and values base64), so the fleet needs no gRPC stack and goes through the project's one HTTP client
// layer (common/http_client.h). Only what etcd 3.4 through 3.6 share is used.
//
// Every call opens one connection to one member, sends one request with an explicit deadline and reads one
// answer under explicit size limits. A member that cannot be reached, times out or answers 5xx is skipped
// for the next one (in order, wrapping); the member that answered last is tried first next time. A 4xx, or
// an etcd error in the body, is the caller's problem and is not retried elsewhere.
//
// Members may be https:// (common/etcd_connection.h: verified certificates, a client certificate, resumed
// sessions).
//
// Thread-safe: calls share nothing but the index of the preferred member (atomic) and the TLS sessions. A call blocks its thread
// for at most `timeout` per member tried, so the node calls it only from its fleet threads, never its loop.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/etcd_connection.h"
#include "common/fd.h"
#include "common/http.h"
#include "common/net.h"

namespace sg::etcd {

struct KeyValue {
  std::string key;
  std::string value;
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
  int64_t version = 0;
  int64_t lease = 0;
};

struct RangeResult {
  int64_t revision = 0;  // the store's revision the answer was read at
  std::vector<KeyValue> kvs;
  bool more = false;     // a limit cut the answer short
};

// One comparison of a transaction (etcd's Compare): `target` of `key` against `number` or `value`.
struct Compare {
  enum class Target { kCreateRevision, kModRevision, kVersion, kValue, kLease };
  enum class Op { kEqual, kNotEqual, kLess, kGreater };
  std::string key = {};
  Target target = Target::kCreateRevision;
  Op op = Op::kEqual;
  int64_t number = 0;      // for every target but kValue
  std::string value = {};  // for kValue
};

// One operation of a transaction's branch.
struct Op {
  enum class Kind { kPut, kDelete, kRange };
  Kind kind = Kind::kRange;
  std::string key = {};
  std::string value = {};      // kPut
  int64_t lease = 0;           // kPut: 0 = no lease (a put without one also detaches the key from its old lease)
  std::string range_end = {};  // kDelete, kRange: "" = just `key`
};

struct TxnResult {
  bool succeeded = false;
  int64_t revision = 0;
  // The answers of the branch's kRange operations, in order (puts and deletes leave no entry).
  std::vector<RangeResult> ranges;
};

struct Lease {
  int64_t id = 0;
  int64_t ttl_secs = 0;
};

struct WatchEvent {
  enum class Type { kPut, kDelete };
  Type type = Type::kPut;
  KeyValue kv;  // for kDelete only key and mod_revision
};

// What one read of a watch stream gave.
struct WatchBatch {
  enum class Kind { kEvents, kCompacted, kIdle };
  Kind kind = Kind::kIdle;     // kIdle: nothing arrived before the read's deadline (the stream is still up)
  int64_t revision = 0;        // kEvents: the header's revision
  std::vector<WatchEvent> events;
  int64_t compact_revision = 0;  // kCompacted: re-list, then watch from the list's revision + 1
};

struct ClientOptions {
  std::vector<Member> members;  // tried in order
  TlsFiles tls = {};            // for https:// members
  std::chrono::milliseconds timeout{2000};  // per member tried: connect + request + answer
  size_t max_answer_bytes = 16 * 1024 * 1024;  // a range of the whole /sandgate/ prefix at 10k sandboxes fits
  size_t max_key_bytes = 1024;
  size_t max_value_bytes = 64 * 1024;
  size_t max_event_bytes = 4 * 1024 * 1024;  // one message of a watch stream
};

// The options [fleet] gives (etcd_endpoints, etcd_timeout_ms, etcd_cacert, ...), the members already checked
// by the config loader; one that does not parse is left out.
ClientOptions client_options(const std::vector<std::string>& members, uint32_t timeout_ms, TlsFiles tls = {});
// The range_end that makes a range or watch cover every key starting with `prefix`.
std::string prefix_end(std::string_view prefix);

class Watch;

class Client {
 public:
  explicit Client(ClientOptions options);

  // Whether the client could be set up (TLS files that load): every call fails with the same reason until
  // then, so a daemon checks this once at its start and refuses to run.
  Status ready() const;

  Result<RangeResult> range(std::string_view key, std::string_view range_end = {}, int64_t limit = 0) const;
  Result<RangeResult> range_prefix(std::string_view prefix) const { return range(prefix, prefix_end(prefix)); }
  // Returns the revision of the write.
  Result<int64_t> put(std::string_view key, std::string_view value, int64_t lease = 0) const;
  // Returns how many keys were deleted.
  Result<int64_t> delete_range(std::string_view key, std::string_view range_end = {}) const;
  Result<TxnResult> txn(const std::vector<Compare>& compares, const std::vector<Op>& success,
                        const std::vector<Op>& failure) const;

  Result<Lease> grant(int64_t ttl_secs) const;
  // The lease's remaining TTL after the renewal; kNotFound once it expired (or was revoked).
  Result<int64_t> keepalive(int64_t lease) const;
  Status revoke(int64_t lease) const;

  // Opens a watch of [key, range_end) from `start_revision` (0: from now), on the first member that confirms
  // it. A start revision already compacted is reported by the stream's first next() (kCompacted).
  Result<std::unique_ptr<Watch>> watch(std::string_view key, std::string_view range_end, int64_t start_revision) const;

  const ClientOptions& options() const { return options_; }
  // Which member answered last (for logs and tests).
  size_t preferred_member() const { return preferred_.load(std::memory_order_relaxed); }
  // TLS handshakes that resumed a member's session instead of a full handshake (for tests).
  size_t resumed_handshakes() const { return tls_ ? tls_->resumed() : 0; }

 private:
  // POSTs `body` to `path` on each member in turn until one answers; returns the parsed JSON body's text.
  Result<std::string> call(std::string_view path, const std::string& body) const;
  Status check_key(std::string_view key) const;

  ClientOptions options_;
  std::shared_ptr<TlsSetup> tls_;          // set when a member is https://
  std::optional<Failure> setup_error_;     // why tls_ could not be made
  mutable std::atomic<size_t> preferred_{0};
};

// A watch stream on one member. next() blocks until a message arrives or its deadline passes; cancel() may
// be called from another thread to make a blocked next() return kUnavailable at once.
class Watch {
 public:
  // `conn`: the connection the watch request went out on; `parser` reads the stream's answer.
  Watch(MemberConnection conn, std::unique_ptr<HttpParser> parser, size_t member);
  ~Watch();
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;

  // kEvents, kCompacted, or kIdle when `wait` passed with nothing; an error once the stream broke
  // (kUnavailable: the member closed it or cancel() ran; kInvalidArgument: a message we cannot read).
  Result<WatchBatch> next(std::chrono::milliseconds wait);
  void cancel();
  size_t member() const { return member_; }

 private:
  // The first complete message in the parsed body, if any (removed from it).
  Result<std::optional<WatchBatch>> take_message();

  MemberConnection conn_;
  std::unique_ptr<HttpParser> parser_;  // its body limit bounds one pending message
  size_t member_;
  std::atomic<bool> cancelled_{false};
  UniqueFd wake_read_, wake_write_;  // cancel() writes here to interrupt poll()
  bool ended_ = false;
};

}  // namespace sg::etcd
