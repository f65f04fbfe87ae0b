// The node API's JSON request bodies (untrusted input), parsed into the typed requests the server acts on:
// every field's type checked, unknown fields refused, the message naming the field. No I/O and no node
// behind them, so they have their own tests (api_request_test.cc) and fuzz target (tests/fuzz/api_body_fuzz.cc)
// without the server; range and policy checks that need the node's state stay in Node.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "noderuntime/build_request.h"
#include "noderuntime/node.h"

namespace sg {

// The body as a JSON object, or why it is not one (empty, not JSON, another type).
Result<nlohmann::json> parse_object(const std::string& body);
// The errors every parser here answers with: "FIELD: must be EXPECTED, got TYPE" and "unknown field".
Failure wrong_type(std::string_view field, std::string_view expected, const nlohmann::json& got);
Failure unknown_field(std::string_view field, std::string_view allowed);

// POST /v1/sandboxes.
Result<CreateRequest> parse_create(const nlohmann::json& body);
// POST /v1/internal/activity: {"sandboxes": [{"id", "bytes_in", "bytes_out", "connections"}], "reporter"},
// read from the text (no JSON tree: it is the one body that comes every second from every proxy worker).
Result<std::vector<ActivityReport>> parse_activity(const std::string& body);

// The body of internal/open and internal/lookup: {"sandbox": "<ref>", "port": N} and, for open only,
// "credentials": every token candidate the request carried, so one open settles auth (the first that verifies
// wins), whatever the number of candidates.
struct PortRequest {
  std::string ref;
  uint16_t port = 0;
  std::vector<std::string> credentials;
  size_t sockets = 0;  // open: spare sockets for the route cache; internal/sockets: how many
  // open and lookup: the client's address as the proxy saw it ("" when not given). An open whose credential
  // verifies lets that address wake the sandbox from its ClientHello later (noderuntime/prewake_gate.h).
  std::string client;
  bool prewake = false;  // lookup: a ClientHello names the port; wake the sandbox if the gate lets it
};

// Which fields a port request may carry besides sandbox and port.
enum class PortRequestKind {
  kLookup,   // client, prewake
  kOpen,     // credentials, spare_sockets, client
  kSockets,  // count
};

// A client address longer than this is refused (an IPv6 text form is at most 45 characters).
inline constexpr size_t kMaxClientAddressLength = 64;

// The edge sends at most this many (proxy/edge_auth.h kMaxCredentialCandidates); each costs a SHA-256.
inline constexpr size_t kMaxCredentialsPerOpen = 4;

// POST /v1/internal/open, internal/lookup and internal/sockets.
Result<PortRequest> parse_port_request(const nlohmann::json& body, PortRequestKind kind);

// POST /v1/sandboxes/NAME/checkpoint: {"type": "filesystem" | "memory"}; no body at all is a filesystem
// checkpoint. The type's name, checked by the node.
Result<std::string> parse_checkpoint(const std::string& text);

// POST /v1/sandboxes/NAME/fork: {"count": 1..kMaxForks, "name_prefix": "p"} (both optional; names are
// "<prefix>-<i>", checked by the create).
inline constexpr uint32_t kMaxForks = 64;
struct ForkRequest {
  uint32_t count = 1;
  std::optional<std::string> name_prefix;
};
Result<ForkRequest> parse_fork(const std::string& text);

// PUT /v1/sandboxes/NAME/ports/PORT: {"public": bool, "protocol": "http1" | "h2c" | "tcp"} (both optional;
// no body at all is a private http1 port). The protocol's name is checked by the node.
Result<ExposeRequest> parse_expose(const std::string& text);

// POST /v1/images/build, checked as the builder checks it (check_build_request).
Result<BuildRequest> parse_build(const nlohmann::json& body);

// The JSON request bodies the API parses before acting on them, by route.
enum class ApiBody {
  kCreate,      // POST /v1/sandboxes
  kBuild,       // POST /v1/images/build
  kOpen,        // POST /v1/internal/open
  kSockets,     // POST /v1/internal/sockets
  kCheckpoint,  // POST /v1/sandboxes/NAME/checkpoint
  kFork,        // POST /v1/sandboxes/NAME/fork
  kLookup,      // POST /v1/internal/lookup
  kActivity,    // POST /v1/internal/activity
  kExpose,      // PUT /v1/sandboxes/NAME/ports/PORT
};
// Parses `body` as its route does: ok, or the kInvalidArgument the route answers with. The entry point of
// the fuzz target for API bodies.
Status check_api_body(ApiBody kind, const std::string& body);

}  // namespace sg
