#include "proxy/unix_node_client.h"

#include <nlohmann/json.hpp>

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
std::unique_ptr<NodeCall> start(uv_loop_t* loop, const ProxyShared* shared, std::string path, std::string body,
                                uint32_t timeout_ms, std::string headers,
                                std::function<void(Result<Answer>)> done, Parse parse) {
  auto call = std::make_unique<RequestCall>();
  call->request = NodeRequest::start(loop, shared->snapshot()->config->node_socket, "POST", std::move(path),
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
  return a;
}

Result<OpenAnswer> parse_open_answer(int status, std::string_view body, UniqueFd fd) {
  auto j = json::parse(body, nullptr, false);
  OpenAnswer a = answer_head<OpenAnswer>(status, j);
  if (status != 200) return a;
  OpenedSocket& o = a.opened;
  if (!j.is_object() || !get_policy(j, &o.port, &o.policy) || !fd.valid()) return not_the_api("internal/open");
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
  o.socket = std::move(fd);
  return a;
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
  return cuts;
}

std::unique_ptr<NodeCall> UnixNodeClient::lookup(const std::string& sandbox, uint16_t port, uint32_t timeout_ms,
                                                 std::function<void(Result<LookupAnswer>)> done) {
  json body = {{"sandbox", sandbox}, {"port", port}};
  return start<LookupAnswer>(loop_, shared_, "/v1/internal/lookup", body.dump(), timeout_ms, "", std::move(done),
                             [](NodeResponse& r) { return parse_lookup_answer(r.status, r.body); });
}

std::unique_ptr<NodeCall> UnixNodeClient::open(const std::string& sandbox, uint16_t port,
                                               std::span<const std::string> credentials, uint32_t wake_timeout_ms,
                                               std::function<void(Result<OpenAnswer>)> done) {
  json body = {{"sandbox", sandbox}, {"port", port}};
  if (!credentials.empty()) body["credentials"] = json(std::vector<std::string>(credentials.begin(), credentials.end()));
  // The node bounds the wake; the exchange gets a second more so its 504 arrives before our own timeout.
  return start<OpenAnswer>(loop_, shared_, "/v1/internal/open", body.dump(), wake_timeout_ms + 1000,
                           "X-Sandgate-Wake-Timeout-Ms: " + std::to_string(wake_timeout_ms) + "\r\n", std::move(done),
                           [](NodeResponse& r) { return parse_open_answer(r.status, r.body, std::move(r.passed_fd)); });
}

std::unique_ptr<NodeCall> UnixNodeClient::report_activity(std::string report_json,
                                                          std::function<void(Result<ActivityCuts>)> done) {
  return start<ActivityCuts>(loop_, shared_, "/v1/internal/activity", std::move(report_json), 5000, "",
                             std::move(done), [](NodeResponse& r) { return parse_activity_answer(r.status, r.body); });
}

}  // namespace sg
