#include "noderuntime/placement.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <limits>
#include <utility>

#include <nlohmann/json.hpp>

#include "common/api_client.h"
#include "common/operator_token.h"

namespace sg {
namespace {

using json = nlohmann::json;

// The message of a node API error answer, else the body as it came (cut short).
std::string answer_message(const std::string& body) {
  json j = json::parse(body, nullptr, false);
  if (j.is_object() && j.contains("message") && j["message"].is_string()) return j["message"].get<std::string>();
  return body.substr(0, 200);
}

CreatePlacer::Answer error_answer(int status, std::string_view code, const std::string& message,
                                  std::string extra_headers = {}) {
  json body = {{"error", code}, {"message", message}};
  return {status, body.dump(-1, ' ', false, json::error_handler_t::replace), std::move(extra_headers)};
}

CreatePlacer::RemoteAnswer http_create(const PlacementOptions& options, const fleet::NodeInfo& node,
                                       const std::string& body) {
  CreatePlacer::RemoteAnswer out;
  auto address = parse_api_address(node.api);
  if (!address) {
    out.error = "its API address '" + node.api + "' is not usable: " + address.message();
    return out;
  }
  auto token = read_operator_token(options.token_file);
  if (!token) {
    out.error = token.message();
    return out;
  }
  IngressAccess access;
  access.token = *token;
  access.cacert = options.cacert;
  access.headers.push_back({std::string(kPlacedByHeader), options.self});
  ApiClient client(*address, options.timeout_ms, std::move(access));
  auto answer = client.request("POST", "/v1/sandboxes", json::parse(body, nullptr, false), &out.reached);
  if (!answer) {
    out.error = answer.message();
    return out;
  }
  out.ok = true;
  out.status = answer->status;
  out.body = std::move(answer->body);
  return out;
}

// The power of two choices over `candidates` (see placement_order), in place.
void order_by_room(std::vector<fleet::NodeInfo>& candidates, std::mt19937_64& rng, const PlacementDemand& demand) {
  if (candidates.size() < 2) return;
  // Shuffled first, so that among nodes with the same room the order is random too.
  std::shuffle(candidates.begin(), candidates.end(), rng);
  if (room_for(candidates[1], demand) > room_for(candidates[0], demand)) std::swap(candidates[0], candidates[1]);
  std::stable_sort(candidates.begin() + 2, candidates.end(), [&](const fleet::NodeInfo& a, const fleet::NodeInfo& b) {
    return room_for(a, demand) > room_for(b, demand);
  });
}

// How many creates of `each` fit in what `capacity` leaves beside `reserved` (0 capacity: no limit).
int64_t creates_that_fit(int64_t capacity, int64_t reserved, int64_t each) {
  if (capacity <= 0) return std::numeric_limits<int64_t>::max();
  const int64_t left = capacity - std::max<int64_t>(reserved, 0);
  if (left <= 0) return 0;
  return each <= 0 ? std::numeric_limits<int64_t>::max() : left / each;
}

}  // namespace

int64_t free_capacity(const fleet::NodeInfo& node) {
  if (node.capacity_sandboxes <= 0) return std::numeric_limits<int64_t>::max();
  return node.capacity_sandboxes - node.sandboxes;
}

int64_t room_for(const fleet::NodeInfo& node, const PlacementDemand& demand) {
  return std::min({free_capacity(node),
                   creates_that_fit(node.capacity_memory_mb, node.reserved_memory_mb, demand.memory_mb),
                   creates_that_fit(node.capacity_millicpus, node.reserved_millicpus, demand.millicpus)});
}

std::vector<fleet::NodeInfo> placement_order(const std::vector<fleet::NodeInfo>& nodes, std::mt19937_64& rng,
                                             const PlacementDemand& demand) {
  std::vector<fleet::NodeInfo> candidates, without_image;
  for (const fleet::NodeInfo& n : nodes) {
    if (n.state != fleet::NodeState::kReady || room_for(n, demand) <= 0) continue;
    (demand.image.empty() || fleet::may_have_image(n, demand.image) ? candidates : without_image).push_back(n);
  }
  order_by_room(candidates, rng, demand);
  order_by_room(without_image, rng, demand);
  candidates.insert(candidates.end(), without_image.begin(), without_image.end());
  return candidates;
}

PlacementRefusal placement_refusal(int status, std::string_view body) {
  if (status == 503 || status == 429) return PlacementRefusal::kUnavailable;
  if (status != 404) return PlacementRefusal::kNone;
  // Another node's answer: any JSON at all, read without a throwing accessor.
  json j = json::parse(body, nullptr, false);
  if (!j.is_object()) return PlacementRefusal::kNone;
  auto missing = j.find(std::string(kMissingField));
  const bool missing_image = missing != j.end() && missing->is_string() && missing->get<std::string>() == kMissingImage;
  return missing_image ? PlacementRefusal::kMissingImage : PlacementRefusal::kNone;
}

struct CreatePlacer::Placement {
  std::string body;
  std::vector<fleet::NodeInfo> order;
  size_t next = 0;
  LocalCreate local;
  Done done;
  std::vector<std::string> refusals;  // "<node>: <why>", for the answer when every node refused
  bool only_missing_image = true;      // every refusal so far said the node has no such image
  bool asked_self = false;
};

CreatePlacer::CreatePlacer(uv_loop_t* loop, PlacementOptions options, RemoteCreate remote)
    : loop_(loop), options_(std::move(options)), remote_(std::move(remote)), alive_(std::make_shared<bool>(true)) {
  if (!remote_) {
    remote_ = [opts = options_](const fleet::NodeInfo& node, const std::string& body) {
      return http_create(opts, node, body);
    };
  }
}

CreatePlacer::~CreatePlacer() { *alive_ = false; }

void CreatePlacer::place(std::string body, std::vector<fleet::NodeInfo> order, LocalCreate local, Done done) {
  if (order.empty()) return local(std::move(done));
  auto p = std::make_shared<Placement>();
  p->body = std::move(body);
  p->order = std::move(order);
  p->local = std::move(local);
  p->done = std::move(done);
  next(std::move(p));
}

void CreatePlacer::next(std::shared_ptr<Placement> p) {
  // A view a moment old may not list this node yet (its key was written just now): it is asked last then,
  // and its own admission decides, so a create never fails only because the view lags.
  if (p->next == p->order.size() && !p->asked_self) {
    fleet::NodeInfo self;
    self.name = options_.self;
    p->order.push_back(std::move(self));
  }
  if (p->next == p->order.size()) {
    std::string why;
    for (const std::string& r : p->refusals) why += (why.empty() ? "" : "; ") + r;
    if (p->only_missing_image)
      return p->done(error_answer(404, "not_found", "fleet: no node has the image (" + why + ")"));
    return p->done(error_answer(503, "unavailable", "fleet: no node admitted the create (" + why + "); retry shortly",
                                "Retry-After: 2\r\n"));
  }
  const fleet::NodeInfo node = p->order[p->next++];
  if (node.name == options_.self) {
    p->asked_self = true;
    return p->local([this, p, alive = alive_, name = node.name](Answer a) {
      if (*alive) answered(p, name, std::move(a));
    });
  }
  struct Work {
    uv_work_t req{};
    CreatePlacer* placer;
    std::shared_ptr<bool> alive;
    std::shared_ptr<Placement> placement;
    fleet::NodeInfo node;
    RemoteCreate remote;
    RemoteAnswer answer;
  };
  auto* w = new Work{{}, this, alive_, p, node, remote_, {}};
  w->req.data = w;
  int rc = uv_queue_work(
      loop_, &w->req,
      [](uv_work_t* r) {
        auto* x = static_cast<Work*>(r->data);
        x->answer = x->remote(x->node, x->placement->body);
      },
      [](uv_work_t* r, int status) {
        std::unique_ptr<Work> x(static_cast<Work*>(r->data));
        if (!*x->alive) return;
        RemoteAnswer& a = x->answer;
        if (status < 0)
          return x->placer->refused(x->placement, x->node.name, "the request was cancelled", PlacementRefusal::kUnavailable);
        if (a.ok) {
          if (placement_refusal(a.status, a.body) == PlacementRefusal::kNone)
            spdlog::info("fleet: placed a create on node {} ({})", x->node.name, a.status);
          return x->placer->answered(x->placement, x->node.name, Answer{a.status, std::move(a.body), {}});
        }
        if (!a.reached) return x->placer->refused(x->placement, x->node.name, a.error, PlacementRefusal::kUnavailable);
        // The node had the request and may have acted on it: creating elsewhere could make a second sandbox.
        x->placement->done(error_answer(502, "unreachable",
                                        "fleet: node " + x->node.name + " took the create but its answer did not come (" +
                                            a.error + "); see `sandgate ls` before creating it again"));
      });
  if (rc < 0) {
    std::unique_ptr<Work> owned(w);
    refused(p, node.name, std::string("uv_queue_work: ") + uv_strerror(rc), PlacementRefusal::kUnavailable);
  }
}

void CreatePlacer::answered(std::shared_ptr<Placement> p, const std::string& node, Answer a) {
  const PlacementRefusal kind = placement_refusal(a.status, a.body);
  if (kind == PlacementRefusal::kNone) return p->done(std::move(a));
  refused(std::move(p), node, answer_message(a.body), kind);
}

void CreatePlacer::refused(std::shared_ptr<Placement> p, const std::string& node, const std::string& why,
                           PlacementRefusal kind) {
  p->refusals.push_back(node + ": " + why);
  if (kind != PlacementRefusal::kMissingImage) p->only_missing_image = false;
  next(std::move(p));
}

}  // namespace sg
