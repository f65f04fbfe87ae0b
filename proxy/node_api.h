// What a proxy asks its node, with typed answers: the port policy at a ClientHello, the open of a sandbox
// port (auth + wake + a socket), and the activity report. Connection and Worker talk to this interface only,
// so their phases are unit-tested against a fake node (tests/unit/proxy/connection_test.cc); the real one
// speaks the node API's JSON over its unix socket (unix_node_client.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/fd.h"
#include "proxy/route_cache.h"

namespace sg {

// A request in flight. Destroying it cancels it: its callback never runs. Destroying it from inside its own
// callback is allowed.
class NodeCall {
 public:
  virtual ~NodeCall() = default;
};

struct LookupAnswer {
  int status = 0;       // the node's HTTP status; 200: `policy` and `port` are set
  std::string message;  // the node's message otherwise
  uint16_t port = 0;
  PortPolicy policy;
  std::string prewake;  // asked for: "woke", "refused" or "not_asleep"; else ""
};

struct OpenAnswer {
  int status = 0;       // the node's HTTP status: 200 opened, 401, 403, 404, 502, 503, 504, ...
  std::string message;  // the node's message when status != 200
  OpenedSocket opened;  // status 200
};

// The node's answer to an activity report: the reported sandboxes whose older connections must go.
struct ActivityCuts {
  struct Cut {
    std::string id;
    uint64_t stamp = 0;  // connections opened before it go
  };
  std::vector<Cut> asleep;   // suspending or suspended
  std::vector<Cut> revoked;  // token rotated
  struct ClosedPort {
    std::string id;
    uint16_t port = 0;
    uint64_t stamp = 0;  // connections to the port opened before it go
  };
  std::vector<ClosedPort> closed;  // a port closed after create (DELETE .../ports/PORT)
};

// A line of the node's route event stream (internal/events).
struct RouteStreamEvent {
  enum class Kind {
    kHello,       // the stream is up: events from `stamp` on will follow
    kInvalidate,  // sandbox `id` stopped running, got a new token or changed its ports (reason "ports")
    kFlush,       // the operator token changed: every route
  };
  Kind kind = Kind::kHello;
  std::string id;
  std::string reason;
  uint64_t stamp = 0;
};

// Who a lookup or an open is for. The node remembers the `address` (no port) of a client whose credential
// verified, and wakes that sandbox at a later ClientHello from the same address when the lookup asks it to
// (`prewake`; noderuntime/prewake_gate.h): the resume then runs during the TLS handshake.
struct ClientHint {
  std::string address;
  bool prewake = false;  // lookup only
};

class NodeClient {
 public:
  virtual ~NodeClient() = default;
  // Failures (the callback's Result): the node did not answer in `timeout_ms` (kTimeout), could not be
  // reached (kUnavailable), or answered something that is not its API (kInternal).
  virtual std::unique_ptr<NodeCall> lookup(const std::string& sandbox, uint16_t port, const ClientHint& client,
                                           uint32_t timeout_ms, std::function<void(Result<LookupAnswer>)> done) = 0;
  // Checks `credentials` (the first that verifies is used) unless the port is public, wakes the sandbox
  // within `wake_timeout_ms`, and hands over a socket to the port.
  virtual std::unique_ptr<NodeCall> open(const std::string& sandbox, uint16_t port,
                                         std::span<const std::string> credentials, const ClientHint& client,
                                         uint32_t wake_timeout_ms, std::function<void(Result<OpenAnswer>)> done) = 0;
  virtual std::unique_ptr<NodeCall> report_activity(std::string report_json,
                                                    std::function<void(Result<ActivityCuts>)> done) = 0;
  // The route cache's two calls. A client without them (nullptr) leaves the cache without routes: every
  // connection then asks the node, as before.
  // `count` more sockets to a port of a running sandbox (by id), without waking it.
  virtual std::unique_ptr<NodeCall> spare_sockets(const std::string& /*sandbox_id*/, uint16_t /*port*/,
                                                  size_t /*count*/, std::function<void(Result<RouteGrant>)> /*done*/) {
    return nullptr;
  }
  // Whether the node may be up: false only when its socket refuses connections or is gone (a connect and
  // nothing more; a unix socket answers at once). A client that cannot tell says true, so the route cache
  // never serves without a node.
  virtual bool accepting() { return true; }
  // The node's route events, until the stream ends (`ended`, once; then the caller reconnects).
  virtual std::unique_ptr<NodeCall> watch_routes(std::function<void(const RouteStreamEvent&)> /*on_event*/,
                                                 std::function<void(Failure)> /*ended*/) {
    return nullptr;
  }
};

}  // namespace sg
