#include "common/etcd_client.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <nlohmann/json.hpp>

#include "common/base64.h"
#include "common/http_client.h"

namespace sg::etcd {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// The gateway writes int64 fields as JSON strings and leaves out every field that has its default value.
Result<int64_t> int_field(const json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end()) return int64_t{0};
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) {
    const std::string& s = it->get_ref<const std::string&>();
    char* end = nullptr;
    errno = 0;
    long long v = std::strtoll(s.c_str(), &end, 10);
    if (errno == 0 && end != s.c_str() && *end == '\0') return static_cast<int64_t>(v);
  }
  return fail(Error::kInvalidArgument, std::string("etcd answer: ") + name + " is not an integer");
}

Result<std::string> bytes_field(const json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end()) return std::string();
  if (!it->is_string()) return fail(Error::kInvalidArgument, std::string("etcd answer: ") + name + " is not a string");
  auto bytes = base64_decode(it->get_ref<const std::string&>());
  if (!bytes) return fail(Error::kInvalidArgument, std::string("etcd answer: ") + name + ": " + bytes.message());
  return bytes;
}

bool bool_field(const json& j, const char* name) {
  auto it = j.find(name);
  return it != j.end() && it->is_boolean() && it->get<bool>();
}

Result<KeyValue> parse_kv(const json& j) {
  if (!j.is_object()) return fail(Error::kInvalidArgument, "etcd answer: a kv is not an object");
  KeyValue kv;
  auto key = bytes_field(j, "key");
  auto value = bytes_field(j, "value");
  auto cr = int_field(j, "create_revision");
  auto mr = int_field(j, "mod_revision");
  auto ver = int_field(j, "version");
  auto lease = int_field(j, "lease");
  for (const Failure* f : {key ? nullptr : &key.failure(), value ? nullptr : &value.failure(),
                           cr ? nullptr : &cr.failure(), mr ? nullptr : &mr.failure(),
                           ver ? nullptr : &ver.failure(), lease ? nullptr : &lease.failure()})
    if (f) return *f;
  kv.key = std::move(*key);
  kv.value = std::move(*value);
  kv.create_revision = *cr;
  kv.mod_revision = *mr;
  kv.version = *ver;
  kv.lease = *lease;
  return kv;
}

Result<int64_t> header_revision(const json& j) {
  auto h = j.find("header");
  if (h == j.end() || !h->is_object()) return int64_t{0};
  return int_field(*h, "revision");
}

Result<RangeResult> parse_range(const json& j) {
  RangeResult r;
  auto rev = header_revision(j);
  if (!rev) return rev.failure();
  r.revision = *rev;
  r.more = bool_field(j, "more");
  auto kvs = j.find("kvs");
  if (kvs == j.end()) return r;
  if (!kvs->is_array()) return fail(Error::kInvalidArgument, "etcd answer: kvs is not an array");
  for (const json& item : *kvs) {
    auto kv = parse_kv(item);
    if (!kv) return kv.failure();
    r.kvs.push_back(std::move(*kv));
  }
  return r;
}

Result<json> parse_json(std::string_view text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return fail(Error::kInvalidArgument, "etcd answer: not a JSON object");
  return j;
}

const char* target_name(Compare::Target t) {
  switch (t) {
    case Compare::Target::kCreateRevision: return "CREATE";
    case Compare::Target::kModRevision: return "MOD";
    case Compare::Target::kVersion: return "VERSION";
    case Compare::Target::kValue: return "VALUE";
    case Compare::Target::kLease: return "LEASE";
  }
  return "CREATE";
}

const char* op_name(Compare::Op o) {
  switch (o) {
    case Compare::Op::kEqual: return "EQUAL";
    case Compare::Op::kNotEqual: return "NOT_EQUAL";
    case Compare::Op::kLess: return "LESS";
    case Compare::Op::kGreater: return "GREATER";
  }
  return "EQUAL";
}

json op_json(const Op& op) {
  json inner = {{"key", base64_encode(op.key)}};
  switch (op.kind) {
    case Op::Kind::kPut:
      inner["value"] = base64_encode(op.value);
      if (op.lease != 0) inner["lease"] = std::to_string(op.lease);
      return {{"request_put", inner}};
    case Op::Kind::kDelete:
      if (!op.range_end.empty()) inner["range_end"] = base64_encode(op.range_end);
      return {{"request_delete_range", inner}};
    case Op::Kind::kRange:
      if (!op.range_end.empty()) inner["range_end"] = base64_encode(op.range_end);
      return {{"request_range", inner}};
  }
  return {};
}

// An error the gateway reports in the body ({"error": ..., "code": N}) with a 4xx/5xx status.
std::string etcd_error(const std::string& body) {
  json j = json::parse(body, nullptr, false);
  if (j.is_object()) {
    auto m = j.find("message");
    if (m != j.end() && m->is_string()) return m->get<std::string>();
    auto e = j.find("error");
    if (e != j.end() && e->is_string()) return e->get<std::string>();
  }
  return body.substr(0, 200);
}

}  // namespace

ClientOptions client_options(const std::vector<std::string>& members, uint32_t timeout_ms, TlsFiles tls) {
  ClientOptions o;
  for (const auto& text : members)
    if (auto m = parse_member(text)) o.members.push_back(*m);
  o.tls = std::move(tls);
  o.timeout = std::chrono::milliseconds(timeout_ms);
  return o;
}

std::string prefix_end(std::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    if (static_cast<unsigned char>(end.back()) < 0xff) {
      end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

Client::Client(ClientOptions options) : options_(std::move(options)) {
  const bool any_tls = std::any_of(options_.members.begin(), options_.members.end(), [](const Member& m) { return m.tls; });
  if (!any_tls) return;
  auto setup = TlsSetup::create(options_.tls, options_.members.size());
  if (setup) tls_ = std::move(*setup);
  else setup_error_ = setup.failure();
}

Status Client::ready() const {
  if (setup_error_) return *setup_error_;
  return {};
}

Status Client::check_key(std::string_view key) const {
  if (key.empty()) return fail(Error::kInvalidArgument, "etcd key is empty");
  if (key.size() > options_.max_key_bytes)
    return fail(Error::kLimitExceeded, "etcd key over " + std::to_string(options_.max_key_bytes) + " bytes");
  return {};
}

Result<std::string> Client::call(std::string_view path, const std::string& body) const {
  if (setup_error_) return *setup_error_;
  if (options_.members.empty()) return fail(Error::kUnavailable, "no etcd members configured");
  const size_t n = options_.members.size();
  const size_t first = preferred_.load(std::memory_order_relaxed) % n;
  std::string errors;
  for (size_t i = 0; i < n; i++) {
    size_t m = (first + i) % n;
    const Member& member = options_.members[m];
    auto deadline = Clock::now() + options_.timeout;
    std::string host = member.endpoint.to_string();
    HttpRequest req{.method = "POST", .target = path, .host = host,
                    .headers = {{"Content-Type", "application/json"}, {"Connection", "close"}}, .body = body};
    auto bytes = build_http_request(req, HttpRequestLimits{.max_body_bytes = 4 * options_.max_value_bytes + 64 * 1024});
    if (!bytes) return bytes.failure();
    auto conn = MemberConnection::open(member, m, tls_.get(), deadline);
    if (!conn) {
      errors += (errors.empty() ? "" : "; ") + host + ": " + conn.message();
      continue;
    }
    HttpResponseReader reader(HttpResponseLimits{.max_head_bytes = 16 * 1024, .max_body_bytes = options_.max_answer_bytes});
    if (Status s = http_exchange(conn->stream(deadline), *bytes, reader); !s) {
      // An answer over the limit would be as large on every member: no point trying the next one.
      if (s.error() == Error::kLimitExceeded) return fail(s.error(), "etcd " + host + ": " + s.message());
      errors += (errors.empty() ? "" : "; ") + host + ": " + s.message();
      continue;
    }
    const HttpMessage& msg = reader.message();
    if (msg.status >= 500) {
      // A member without a leader or quorum answers 5xx (or 503 while it starts): another may serve.
      errors += (errors.empty() ? "" : "; ") + host + ": " + std::to_string(msg.status) + " " + etcd_error(msg.body);
      continue;
    }
    preferred_.store(m, std::memory_order_relaxed);
    if (msg.status != 200)
      return fail(msg.status == 404 ? Error::kUnsupported : Error::kInvalidArgument,
                  "etcd " + host + " refused " + std::string(path) + ": " + std::to_string(msg.status) + " " +
                      etcd_error(msg.body));
    return msg.body;
  }
  return fail(Error::kUnavailable, "no etcd member answered (" + errors + ")");
}

Result<RangeResult> Client::range(std::string_view key, std::string_view range_end, int64_t limit) const {
  if (Status s = check_key(key); !s) return s.failure();
  json req = {{"key", base64_encode(key)}};
  if (!range_end.empty()) req["range_end"] = base64_encode(range_end);
  if (limit > 0) req["limit"] = std::to_string(limit);
  auto body = call("/v3/kv/range", req.dump());
  if (!body) return body.failure();
  auto j = parse_json(*body);
  if (!j) return j.failure();
  return parse_range(*j);
}

Result<int64_t> Client::put(std::string_view key, std::string_view value, int64_t lease) const {
  if (Status s = check_key(key); !s) return s.failure();
  if (value.size() > options_.max_value_bytes)
    return fail(Error::kLimitExceeded, "etcd value over " + std::to_string(options_.max_value_bytes) + " bytes");
  json req = {{"key", base64_encode(key)}, {"value", base64_encode(value)}};
  if (lease != 0) req["lease"] = std::to_string(lease);
  auto body = call("/v3/kv/put", req.dump());
  if (!body) return body.failure();
  auto j = parse_json(*body);
  if (!j) return j.failure();
  return header_revision(*j);
}

Result<int64_t> Client::delete_range(std::string_view key, std::string_view range_end) const {
  if (Status s = check_key(key); !s) return s.failure();
  json req = {{"key", base64_encode(key)}};
  if (!range_end.empty()) req["range_end"] = base64_encode(range_end);
  auto body = call("/v3/kv/deleterange", req.dump());
  if (!body) return body.failure();
  auto j = parse_json(*body);
  if (!j) return j.failure();
  return int_field(*j, "deleted");
}

Result<TxnResult> Client::txn(const std::vector<Compare>& compares, const std::vector<Op>& success,
                              const std::vector<Op>& failure) const {
  json req = json::object();
  json cmp = json::array();
  for (const Compare& c : compares) {
    if (Status s = check_key(c.key); !s) return s.failure();
    json one = {{"key", base64_encode(c.key)}, {"target", target_name(c.target)}, {"result", op_name(c.op)}};
    switch (c.target) {
      case Compare::Target::kCreateRevision: one["create_revision"] = std::to_string(c.number); break;
      case Compare::Target::kModRevision: one["mod_revision"] = std::to_string(c.number); break;
      case Compare::Target::kVersion: one["version"] = std::to_string(c.number); break;
      case Compare::Target::kLease: one["lease"] = std::to_string(c.number); break;
      case Compare::Target::kValue: one["value"] = base64_encode(c.value); break;
    }
    cmp.push_back(std::move(one));
  }
  req["compare"] = std::move(cmp);
  for (auto [name, ops] : {std::pair{"success", &success}, std::pair{"failure", &failure}}) {
    json arr = json::array();
    for (const Op& op : *ops) {
      if (Status s = check_key(op.key); !s) return s.failure();
      if (op.value.size() > options_.max_value_bytes)
        return fail(Error::kLimitExceeded, "etcd value over " + std::to_string(options_.max_value_bytes) + " bytes");
      arr.push_back(op_json(op));
    }
    req[name] = std::move(arr);
  }
  auto body = call("/v3/kv/txn", req.dump());
  if (!body) return body.failure();
  auto j = parse_json(*body);
  if (!j) return j.failure();
  TxnResult r;
  auto rev = header_revision(*j);
  if (!rev) return rev.failure();
  r.revision = *rev;
  r.succeeded = bool_field(*j, "succeeded");
  auto responses = j->find("responses");
  if (responses != j->end() && responses->is_array()) {
    for (const json& resp : *responses) {
      if (!resp.is_object()) continue;
      auto rr = resp.find("response_range");
      if (rr == resp.end()) continue;
      auto parsed = parse_range(*rr);
      if (!parsed) return parsed.failure();
      r.ranges.push_back(std::move(*parsed));
    }
  }
  return r;
}

Result<Lease> Client::grant(int64_t ttl_secs) const {
  if (ttl_secs < 1) return fail(Error::kInvalidArgument, "lease TTL must be at least 1 s");
  auto body = call("/v3/lease/grant", json{{"TTL", std::to_string(ttl_secs)}}.dump());
  if (!body) return body.failure();
  auto j = parse_json(*body);
  if (!j) return j.failure();
  if (auto e = j->find("error"); e != j->end() && e->is_string() && !e->get_ref<const std::string&>().empty())
    return fail(Error::kUnavailable, "etcd lease grant: " + e->get<std::string>());
  auto id = int_field(*j, "ID");
  auto ttl = int_field(*j, "TTL");
  if (!id) return id.failure();
  if (!ttl) return ttl.failure();
  if (*id == 0) return fail(Error::kInvalidArgument, "etcd lease grant: no lease ID in the answer");
  return Lease{*id, *ttl};
}

Result<int64_t> Client::keepalive(int64_t lease) const {
  // A stream in gRPC; through the gateway one request in, one {"result": ...} out.
  auto body = call("/v3/lease/keepalive", json{{"ID", std::to_string(lease)}}.dump());
  if (!body) return body.failure();
  auto j = parse_json(*body);
  if (!j) return j.failure();
  auto result = j->find("result");
  if (result == j->end() || !result->is_object())
    return fail(Error::kInvalidArgument, "etcd lease keepalive: no result in the answer");
  auto ttl = int_field(*result, "TTL");
  if (!ttl) return ttl.failure();
  // An expired or unknown lease comes back with TTL 0 (left out).
  if (*ttl <= 0) return fail(Error::kNotFound, "etcd lease " + std::to_string(lease) + " has expired");
  return *ttl;
}

Status Client::revoke(int64_t lease) const {
  auto body = call("/v3/lease/revoke", json{{"ID", std::to_string(lease)}}.dump());
  if (!body) {
    // etcd answers an unknown lease with a 4xx "requested lease not found": already gone is what we wanted.
    if (body.message().find("lease not found") != std::string::npos) return {};
    return body.failure();
  }
  return {};
}

Result<std::unique_ptr<Watch>> Client::watch(std::string_view key, std::string_view range_end,
                                             int64_t start_revision) const {
  if (Status s = check_key(key); !s) return s.failure();
  json create = {{"key", base64_encode(key)}};
  if (!range_end.empty()) create["range_end"] = base64_encode(range_end);
  if (start_revision > 0) create["start_revision"] = std::to_string(start_revision);
  std::string body = json{{"create_request", create}}.dump();
  if (setup_error_) return *setup_error_;
  if (options_.members.empty()) return fail(Error::kUnavailable, "no etcd members configured");
  const size_t n = options_.members.size();
  const size_t first = preferred_.load(std::memory_order_relaxed) % n;
  std::string errors;
  for (size_t i = 0; i < n; i++) {
    size_t m = (first + i) % n;
    const Member& member = options_.members[m];
    std::string host = member.endpoint.to_string();
    auto deadline = Clock::now() + options_.timeout;
    HttpRequest req{.method = "POST", .target = "/v3/watch", .host = host,
                    .headers = {{"Content-Type", "application/json"}}, .body = body};
    auto bytes = build_http_request(req);
    if (!bytes) return bytes.failure();
    auto conn = MemberConnection::open(member, m, tls_.get(), deadline);
    if (!conn) {
      errors += (errors.empty() ? "" : "; ") + host + ": " + conn.message();
      continue;
    }
    if (Status s = conn->stream(deadline).write_all(*bytes); !s) {
      errors += (errors.empty() ? "" : "; ") + host + ": " + s.message();
      continue;
    }
    // The head, then the stream's first message ("created": true), within the deadline: a member that
    // takes the connection but cannot serve the watch is skipped like one that refuses it.
    auto parser = std::make_unique<HttpParser>(HttpParser::Kind::kResponse,
                                               HttpLimits{.max_head_bytes = 16 * 1024, .max_body_bytes = options_.max_event_bytes});
    auto watch = std::make_unique<Watch>(std::move(*conn), std::move(parser), m);
    auto first_msg = watch->next(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
    if (!first_msg) {
      errors += (errors.empty() ? "" : "; ") + host + ": " + first_msg.message();
      continue;
    }
    if (first_msg->kind == WatchBatch::Kind::kIdle) {
      errors += (errors.empty() ? "" : "; ") + host + ": the watch was not confirmed in time";
      continue;
    }
    if (first_msg->kind == WatchBatch::Kind::kCompacted)
      return fail(Error::kConflict, "etcd watch from revision " + std::to_string(start_revision) +
                                        " is compacted (compact revision " + std::to_string(first_msg->compact_revision) + ")");
    preferred_.store(m, std::memory_order_relaxed);
    return watch;
  }
  return fail(Error::kUnavailable, "no etcd member took the watch (" + errors + ")");
}

Watch::Watch(MemberConnection conn, std::unique_ptr<HttpParser> parser, size_t member)
    : conn_(std::move(conn)), parser_(std::move(parser)), member_(member) {
  int p[2];
  if (::pipe2(p, O_CLOEXEC | O_NONBLOCK) == 0) {
    wake_read_ = UniqueFd(p[0]);
    wake_write_ = UniqueFd(p[1]);
  }
}

Watch::~Watch() = default;

void Watch::cancel() {
  cancelled_.store(true);
  if (wake_write_.valid()) {
    char c = 1;
    (void)!::write(wake_write_.get(), &c, 1);
  }
}

Result<std::optional<WatchBatch>> Watch::take_message() {
  std::string& body = parser_->message().body;
  // The gateway ends each message with a newline (and a chunk), so a line is a message.
  size_t nl = body.find('\n');
  if (nl == std::string::npos) return std::optional<WatchBatch>();
  std::string line = body.substr(0, nl);
  body.erase(0, nl + 1);
  if (line.empty()) return std::optional<WatchBatch>();
  auto j = parse_json(line);
  if (!j) return j.failure();
  if (auto e = j->find("error"); e != j->end())
    return fail(Error::kUnavailable, "etcd watch ended: " + etcd_error(line));
  auto result = j->find("result");
  if (result == j->end() || !result->is_object()) return fail(Error::kInvalidArgument, "etcd watch: a message without result");
  WatchBatch batch;
  auto rev = header_revision(*result);
  if (!rev) return rev.failure();
  batch.revision = *rev;
  if (bool_field(*result, "canceled")) {
    auto compact = int_field(*result, "compact_revision");
    if (!compact) return compact.failure();
    if (*compact > 0) {
      batch.kind = WatchBatch::Kind::kCompacted;
      batch.compact_revision = *compact;
      return std::optional<WatchBatch>(std::move(batch));
    }
    return fail(Error::kUnavailable, "etcd cancelled the watch");
  }
  batch.kind = WatchBatch::Kind::kEvents;
  auto events = result->find("events");
  if (events != result->end() && events->is_array()) {
    for (const json& ev : *events) {
      if (!ev.is_object()) return fail(Error::kInvalidArgument, "etcd watch: an event is not an object");
      WatchEvent e;
      auto type = ev.find("type");
      e.type = (type != ev.end() && type->is_string() && type->get_ref<const std::string&>() == "DELETE")
                   ? WatchEvent::Type::kDelete
                   : WatchEvent::Type::kPut;
      auto kv = ev.find("kv");
      if (kv == ev.end()) return fail(Error::kInvalidArgument, "etcd watch: an event without kv");
      auto parsed = parse_kv(*kv);
      if (!parsed) return parsed.failure();
      e.kv = std::move(*parsed);
      batch.events.push_back(std::move(e));
    }
  }
  return std::optional<WatchBatch>(std::move(batch));
}

Result<WatchBatch> Watch::next(std::chrono::milliseconds wait) {
  auto deadline = Clock::now() + wait;
  for (;;) {
    if (cancelled_.load()) return fail(Error::kUnavailable, "etcd watch cancelled");
    if (parser_->head_done()) {
      const HttpMessage& msg = parser_->message();
      if (msg.status != 200) return fail(Error::kUnavailable, "etcd watch refused: " + std::to_string(msg.status));
      auto taken = take_message();
      if (!taken) return taken.failure();
      if (*taken) return std::move(**taken);
    }
    if (ended_) return fail(Error::kUnavailable, "etcd closed the watch stream");
    // Read first: TLS may hold decrypted bytes the socket no longer shows; poll only when nothing is there.
    char buf[16 * 1024];
    auto r = conn_.read_now(buf, sizeof buf);
    if (!r) return fail(Error::kUnavailable, "etcd watch stream broke: " + r.message());
    if (r->ended) {
      ended_ = true;
      continue;  // messages already buffered are still delivered
    }
    if (r->bytes == 0) {
      pollfd fds[2] = {{conn_.fd(), r->wait_events, 0}, {wake_read_.get(), POLLIN, 0}};
      int rc = ::poll(fds, wake_read_.valid() ? 2 : 1, remaining_ms(deadline));
      if (rc < 0 && errno != EINTR) return fail_errno("poll", errno);
      if (rc == 0) return WatchBatch{};  // kIdle
      continue;  // readable, or cancelled (checked at the loop's top)
    }
    auto st = parser_->feed(buf, r->bytes);
    if (st == HttpParser::State::kError)
      return fail(parser_->failure().code, "etcd watch stream: " + parser_->failure().message);
    if (st == HttpParser::State::kMessageComplete) ended_ = true;
  }
}

}  // namespace sg::etcd
