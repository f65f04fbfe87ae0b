// Fleet placement (docs/fleet.md#placement): a create that reaches any node of a fleet (its socket, its TCP
// API, or api.<domain> through its proxy) is placed on a node chosen from the node's view of etcd. The
// chosen node admits it or refuses it; a refusal for want of room or availability is retried on the next.
#pragma once

#include <uv.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "common/fleet_directory.h"

namespace sg {

// A placed create carries this header, naming the node that placed it, to the node chosen for it: that node
// admits or refuses and never places it again (so two stale views cannot bounce a create between them).
inline constexpr std::string_view kPlacedByHeader = "X-Sandgate-Placed-By";

// How many sandboxes more `node` says it takes: capacity_sandboxes 0 is no limit.
int64_t free_capacity(const fleet::NodeInfo& node);

// What a create asks of the node it lands on.
struct PlacementDemand {
  std::string image;       // empty: the create names none
  int64_t memory_mb = 0;   // its memory_mb and cpus (thousandths of a core): the reservation it would add
  int64_t millicpus = 0;
};

// How many more sandboxes of `demand`'s size `node` takes by what it published: the least of its free
// sandbox slots, its unreserved memory and its unreserved CPUs, each counted in creates of this size (a
// capacity of 0 is no limit).
int64_t room_for(const fleet::NodeInfo& node, const PlacementDemand& demand);

// The nodes to ask, in order. Two ready nodes with room for the create, picked at random, the one with more
// room first (the power of two choices: close to the least loaded node, without every placer herding onto the
// one node a view that is a moment old calls the emptiest); then every other ready node with room, most room
// first. Draining nodes and those without room are left out. Fewer than two candidates: those there are.
// With an image, the nodes whose published images lack it come after all the others, in the same order
// among themselves: they are still asked (their list may be a renewal old), but last.
std::vector<fleet::NodeInfo> placement_order(const std::vector<fleet::NodeInfo>& nodes, std::mt19937_64& rng,
                                             const PlacementDemand& demand = {});

// A node's answer to a create it cannot take because it does not have the image carries this in its JSON
// body ("missing": "image"): placement then asks the next node.
inline constexpr std::string_view kMissingField = "missing";
inline constexpr std::string_view kMissingImage = "image";

// Why a chosen node's answer sends the create on to the next node, if it does: it could not take the
// sandbox now (503: fenced or draining; 429: full), or it has no such image (404 marked as above). None of
// these says anything against the request itself.
enum class PlacementRefusal { kNone, kUnavailable, kMissingImage };
PlacementRefusal placement_refusal(int status, std::string_view body);

struct PlacementOptions {
  std::string self;             // this node's name in the fleet
  std::string token_file;       // the operator token sent to the chosen node (the nodes of a fleet share one)
  std::string cacert;           // https API addresses are verified against it ("" = the system's store)
  int timeout_ms = 120'000;     // per node asked: a create may pull an image or boot a VM
};

class CreatePlacer {
 public:
  struct Answer {
    int status = 0;
    std::string body;           // JSON, the node API's answer
    std::string extra_headers;  // "Name: value\r\n" lines (Retry-After)
  };
  using Done = std::function<void(Answer)>;
  // The create on this node, answering as the API does.
  using LocalCreate = std::function<void(Done)>;
  // Sends the create to `node`'s API and waits for the answer; runs on a thread of libuv's pool, never on the
  // loop. `reached` says whether the node got the request (connected), so a failure may be retried only if
  // not. The default talks HTTP to node.api with the operator token; tests give a fake.
  struct RemoteAnswer {
    bool reached = false;
    bool ok = false;        // an answer came: status and body are it; else `error` says why not
    int status = 0;
    std::string body;
    std::string error;
  };
  using RemoteCreate = std::function<RemoteAnswer(const fleet::NodeInfo& node, const std::string& body)>;

  CreatePlacer(uv_loop_t* loop, PlacementOptions options, RemoteCreate remote = {});
  ~CreatePlacer();
  CreatePlacer(const CreatePlacer&) = delete;
  CreatePlacer& operator=(const CreatePlacer&) = delete;

  // Asks the nodes of `order` in turn (this node through `local`), `done` on the loop with the first answer
  // that is not a retried refusal; when every node refused, a 503 naming each node's reason (a 404 when
  // none of them has the image: the request cannot succeed by being retried later). This node is
  // asked last if `order` does not hold it (a view that does not list it yet), so an empty order (no view of
  // the fleet yet, or no node with room in it) creates here, whose answer says why not.
  void place(std::string body, std::vector<fleet::NodeInfo> order, LocalCreate local, Done done);

 private:
  struct Placement;
  void next(std::shared_ptr<Placement> p);
  // `node`'s answer: the placement's, unless it is a refusal to retry elsewhere.
  void answered(std::shared_ptr<Placement> p, const std::string& node, Answer a);
  // `node` did not take the create (`why`, for the reason `kind`): the next node is asked.
  void refused(std::shared_ptr<Placement> p, const std::string& node, const std::string& why, PlacementRefusal kind);

  uv_loop_t* loop_;
  PlacementOptions options_;
  RemoteCreate remote_;
  std::shared_ptr<bool> alive_;
};

}  // namespace sg
