#include "proxy/unix_node_client.h"

#include <sys/socket.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>

#include "proxy/worker.h"

namespace sg {
namespace {

using nlohmann::json;

class RequestCall : public NodeCall {
 public:
  std::unique_ptr<NodeRequest> request;
};

std::string message_of(const json& j) {
  return j.is_object() && j.contains("message") && j["message"].is_string() ? j["message"].get<std::string>() : "";
}

bool get_string(const json& j, const char* key, std::string* out) {
  if (!j.contains(key) || !j[key].is_string()) return false;
  *out = j[key].get<std::string>();
  return true;
}

bool get_port(const json& j, const char* key, uint16_t* out) {
  if (!j.contains(key) || !j[key].is_number_unsigned()) return false;
  const uint64_t v = j[key].get<uint64_t>();
  if (v < 1 || v > 65535) return false;
  *out = static_cast<uint16_t>(v);
  return true;
}

bool get_bool(const json& j, const char* key) { return j.contains(key) && j[key].is_boolean() && j[key].get<bool>(); }

// {"id", "port", "protocol", "public"}: what lookup and open answers share.
bool get_policy(const json& j, uint16_t* port, PortPolicy* policy) {
  if (!get_string(j, "id", &policy->sandbox_id) || !get_port(j, "port", port) ||
      !get_string(j, "protocol", &policy->protocol))
    return false;
  policy->is_public = get_bool(j, "public");
  return true;
}

Failure not_the_api(std::string_view what) {
  return fail(Error::kInternal, "bad answer from sandgate-node to " + std::string(what));
}

template <typename Answer, typename Parse>
std::unique_ptr<NodeCall> start(uv_loop_t* loop, SocketWatchSet* sockets, const ProxyShared* shared, std::string path, std::string body,
                                uint32_t timeout_ms, std::string headers,
                                std::function<void(Result<Answer>)> done, Parse parse) {
  auto call = std::make_unique<RequestCall>();
  call->request = NodeRequest::start(loop, sockets, shared->snapshot()->config->node_socket, "POST", std::move(path),
                                     std::move(body), timeout_ms, std::move(headers),
                                     [done = std::move(done), parse](Result<NodeResponse> r) {
                                       if (!r) return done(r.failure());
                                       done(parse(*r));
                                     });
  return call;
}

// Status and, for a refusal (anything but 200), the node's message: all a refusal carries.
template <typename Answer>
Answer answer_head(int status, const json& j) {
  Answer a;
  a.status = status;
  if (status != 200) a.message = message_of(j);
  return a;
}

}  // namespace

Result<LookupAnswer> parse_lookup_answer(int status, std::string_view body) {
  auto j = json::parse(body, nullptr, false);
  LookupAnswer a = answer_head<LookupAnswer>(status, j);
  if (status != 200) return a;
  if (!j.is_object() || !get_policy(j, &a.port, &a.policy)) return not_the_api("internal/lookup");
  if (j.contains("prewake") && j["prewake"].is_string()) a.prewake = j["prewake"].get<std::string>();
  return a;
}

Result<OpenAnswer> parse_open_answer(int status, std::string_view body, std::vector<UniqueFd> fds) {
  auto j = json::parse(body, nullptr, false);
  OpenAnswer a = answer_head<OpenAnswer>(status, j);
  if (status != 200) return a;
  OpenedSocket& o = a.opened;
  if (!j.is_object() || !get_policy(j, &o.port, &o.policy) || fds.empty() || !fds.front().valid())
    return not_the_api("internal/open");
  o.id = o.policy.sandbox_id;
  o.woke = get_bool(j, "woke");
  if (j.contains("wake_ms") && j["wake_ms"].is_number()) o.wake_ms = j["wake_ms"].get<double>();
  // A node that predates connect_port gives only `port`, which is right while the two are equal.
  if (!get_port(j, "connect_port", &o.connect_port)) o.connect_port = o.port;
  o.connected = get_bool(j, "connected");
  if (j.contains("opened_at") && j["opened_at"].is_number_unsigned()) o.opened_at = j["opened_at"].get<uint64_t>();
  get_string(j, "token_sha256", &o.token_sha256);
  if (j.contains("credential") && j["credential"].is_number_unsigned())
    o.credential = static_cast<size_t>(j["credential"].get<uint64_t>());
  o.socket = std::move(fds.front());
  // Spares only when the answer accounts for each one (the rest were closed with `fds`), their namespace last.
  uint64_t spares = j.contains("spare_sockets") && j["spare_sockets"].is_number_unsigned() ? j["spare_sockets"].get<uint64_t>() : 0;
  const size_t netns = get_bool(j, "netns") ? 1 : 0;
  if (spares > 0 && spares <= kMaxSpareSockets && spares + netns + 1 == fds.size()) {
    for (size_t i = 1; i <= spares; ++i) o.spares.push_back(std::move(fds[i]));
    if (netns) o.netns = std::move(fds.back());
    if (j.contains("cache_ms") && j["cache_ms"].is_number_unsigned())
      o.cache_ms = static_cast<uint32_t>(std::min<uint64_t>(j["cache_ms"].get<uint64_t>(), RouteCache::kMaxRouteMs));
    get_string(j, "operator_token_sha256", &o.operator_token_sha256);
  }
  return a;
}

Result<RouteGrant> parse_sockets_answer(int status, std::string_view body, std::vector<UniqueFd> fds) {
  auto j = json::parse(body, nullptr, false);
  if (status != 200) return fail(Error::kUnavailable, "internal/sockets: " + std::to_string(status) + " " + message_of(j));
  RouteGrant g;
  const size_t netns = j.is_object() && get_bool(j, "netns") ? 1 : 0;
  if (!j.is_object() || !get_string(j, "id", &g.sandbox_id) || !get_port(j, "port", &g.port) ||
      !get_port(j, "connect_port", &g.connect_port) || !j.contains("count") || !j["count"].is_number_unsigned() ||
      j["count"].get<uint64_t>() > kMaxSpareSockets || j["count"].get<uint64_t>() + netns != fds.size() ||
      !j.contains("opened_at") || !j["opened_at"].is_number_unsigned())
    return not_the_api("internal/sockets");
  g.opened_at = j["opened_at"].get<uint64_t>();
  if (j.contains("cache_ms") && j["cache_ms"].is_number_unsigned())
    g.cache_ms = static_cast<uint32_t>(std::min<uint64_t>(j["cache_ms"].get<uint64_t>(), RouteCache::kMaxRouteMs));
  get_string(j, "token_sha256", &g.token_sha256);
  get_string(j, "operator_token_sha256", &g.operator_token_sha256);
  if (netns) {
    g.netns = std::move(fds.back());
    fds.pop_back();
  }
  g.spares = std::move(fds);
  return g;
}

Result<RouteStreamEvent> parse_route_event(std::string_view line) {
  auto j = json::parse(line, nullptr, false);
  RouteStreamEvent e;
  std::string kind;
  if (!j.is_object() || !get_string(j, "event", &kind) || !j.contains("stamp") || !j["stamp"].is_number_unsigned())
    return not_the_api("internal/events");
  e.stamp = j["stamp"].get<uint64_t>();
  get_string(j, "reason", &e.reason);
  if (kind == "hello") {
    e.kind = RouteStreamEvent::Kind::kHello;
  } else if (kind == "flush") {
    e.kind = RouteStreamEvent::Kind::kFlush;
  } else if (kind == "invalidate" && get_string(j, "id", &e.id) && !e.id.empty()) {
    e.kind = RouteStreamEvent::Kind::kInvalidate;
  } else {
    return not_the_api("internal/events");
  }
  return e;
}

Result<ActivityCuts> parse_activity_answer(int status, std::string_view body) {
  if (status >= 300) return fail(Error::kInternal, "activity report rejected: " + std::to_string(status) + " " + std::string(body));
  auto j = json::parse(body, nullptr, false);
  if (!j.is_object()) return not_the_api("internal/activity");
  ActivityCuts cuts;
  for (auto [list, out, stamp_key] : {std::tuple{"asleep", &cuts.asleep, "suspended_at"},
                                      std::tuple{"revoked", &cuts.revoked, "rotated_at"}}) {
    if (!j.contains(list) || !j[list].is_array()) continue;
    for (const json& e : j[list]) {
      ActivityCuts::Cut cut;
      if (!e.is_object() || !get_string(e, "id", &cut.id) || !e.contains(stamp_key) || !e[stamp_key].is_number_unsigned())
        continue;
      cut.stamp = e[stamp_key].get<uint64_t>();
      out->push_back(std::move(cut));
    }
  }
  if (j.contains("closed") && j["closed"].is_array()) {
    for (const json& e : j["closed"]) {
      ActivityCuts::ClosedPort cut;
      if (!e.is_object() || !get_string(e, "id", &cut.id) || !e.contains("port") || !e["port"].is_number_unsigned() ||
          e["port"].get<uint64_t>() == 0 || e["port"].get<uint64_t>() > 65535 || !e.contains("closed_at") ||
          !e["closed_at"].is_number_unsigned())
        continue;
      cut.port = static_cast<uint16_t>(e["port"].get<uint64_t>());
      cut.stamp = e["closed_at"].get<uint64_t>();
      cuts.closed.push_back(std::move(cut));
    }
  }
  return cuts;
}

std::unique_ptr<NodeCall> UnixNodeClient::lookup(const std::string& sandbox, uint16_t port, const ClientHint& client,
                                                 uint32_t timeout_ms, std::function<void(Result<LookupAnswer>)> done) {
  json body = {{"sandbox", sandbox}, {"port", port}};
  if (!client.address.empty()) body["client"] = client.address;
  if (client.prewake) body["prewake"] = true;
  return start<LookupAnswer>(loop_, sockets_, shared_, "/v1/internal/lookup", body.dump(), timeout_ms, "", std::move(done),
                             [](NodeResponse& r) { return parse_lookup_answer(r.status, r.body); });
}

std::unique_ptr<NodeCall> UnixNodeClient::open(const std::string& sandbox, uint16_t port,
                                               std::span<const std::string> credentials, const ClientHint& client,
                                               uint32_t wake_timeout_ms, std::function<void(Result<OpenAnswer>)> done) {
  json body = {{"sandbox", sandbox}, {"port", port}};
  if (!client.address.empty()) body["client"] = client.address;
  if (shared_->snapshot()->config->proxy.route_cache) body["spare_sockets"] = RouteCache::kSparesPerGrant;
  if (!credentials.empty()) body["credentials"] = json(std::vector<std::string>(credentials.begin(), credentials.end()));
  // The node bounds the wake; the exchange gets a second more so its 504 arrives before our own timeout.
  return start<OpenAnswer>(loop_, sockets_, shared_, "/v1/internal/open", body.dump(), wake_timeout_ms + 1000,
                           "X-Sandgate-Wake-Timeout-Ms: " + std::to_string(wake_timeout_ms) + "\r\n", std::move(done),
                           [](NodeResponse& r) { return parse_open_answer(r.status, r.body, std::move(r.passed_fds)); });
}

std::unique_ptr<NodeCall> UnixNodeClient::report_activity(std::string report_json,
                                                          std::function<void(Result<ActivityCuts>)> done) {
  return start<ActivityCuts>(loop_, sockets_, shared_, "/v1/internal/activity", std::move(report_json), 5000, "",
                             std::move(done), [](NodeResponse& r) { return parse_activity_answer(r.status, r.body); });
}

std::unique_ptr<NodeCall> UnixNodeClient::spare_sockets(const std::string& sandbox_id, uint16_t port, size_t count,
                                                        std::function<void(Result<RouteGrant>)> done) {
  json body = {{"sandbox", sandbox_id}, {"port", port}, {"count", count}};
  return start<RouteGrant>(loop_, sockets_, shared_, "/v1/internal/sockets", body.dump(), 5000, "", std::move(done),
                           [](NodeResponse& r) { return parse_sockets_answer(r.status, r.body, std::move(r.passed_fds)); });
}

std::unique_ptr<NodeCall> UnixNodeClient::watch_routes(std::function<void(const RouteStreamEvent&)> on_event,
                                                       std::function<void(Failure)> ended) {
  auto call = std::make_unique<RequestCall>();
  // A line that is not the API ends the stream: an event that cannot be read may be an invalidation.
  auto failed = std::make_shared<std::optional<Failure>>();
  call->request = NodeRequest::stream(
      loop_, sockets_, shared_->snapshot()->config->node_socket, "/v1/internal/events", 5000,
      [on_event, failed](std::string_view line) {
        if (*failed) return;
        auto e = parse_route_event(line);
        if (!e) {
          *failed = e.failure();
          return;
        }
        on_event(*e);
      },
      [ended, failed](Result<NodeResponse> r) {
        if (*failed) return ended(**failed);
        if (!r) return ended(r.failure());
        ended(fail(Error::kUnavailable, "internal/events answered " + std::to_string(r->status)));
      });
  return call;
}

bool UnixNodeClient::accepting() {
  auto sa = to_sockaddr(shared_->snapshot()->config->node_socket);
  if (!sa) return true;  // not a path to try: assume it is there, as every other call does
  UniqueFd fd(::socket(sa->storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return true;
  // A listening unix socket accepts or refuses at once. Only a refusal or no socket at all is a node that is
  // down; anything else (a full backlog, a permission the proxy's user lacks) may be a node that is up.
  if (::connect(fd.get(), sa->get(), sa->len) == 0) return true;
  return errno != ECONNREFUSED && errno != ENOENT;
}

}  // namespace sg
