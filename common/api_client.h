// A small blocking HTTP/1.1 client for the sandgate-node API (docs/node-api.md), used by the `sandgate` CLI
// and by a node that places a create on another node of its fleet (noderuntime/placement.h).
// The API is reached directly (its unix socket or loopback port) or through the TLS ingress at
// https://api.<domain>, which wants the operator token. Both speak the same HTTP/1.1 over a different stream.
// One request per connection: the CLI makes one call per run, so keep-alive would buy nothing.
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/tls_client.h"
#include "common/error.h"
#include "common/net.h"

namespace sg {

inline constexpr std::string_view kDefaultApi = "unix:/run/sandgate/node.sock";
// The next step when nothing answers at the API address.
inline constexpr std::string_view kNodeDownHint =
    "Is sandgate-node running? Start it (deploy/quickstart.sh, or systemctl start sandgate-node), or point "
    "SANDGATE_API (or --api) at the address it serves, e.g. export SANDGATE_API=unix:$PWD/.state/node.sock "
    "as the quickstart prints";
// The next step when something answers at the API address, but not as sandgate-node does.
inline constexpr std::string_view kCheckApiHint =
    "is that sandgate-node's API? Check --api / SANDGATE_API (unix:/path/to/node.sock, "
    "http://127.0.0.1:PORT or https://api.DOMAIN[:PORT]; the quickstart prints the value to export)";

struct ApiAddress {
  enum class Kind { kDirect, kHttps } kind = Kind::kDirect;
  Endpoint endpoint;  // kDirect: the node's socket or loopback port
  Ingress server;     // kHttps: the URL's host (the name the certificate must carry) and port (default 443)
};

// "unix:/path", "http://HOST:PORT[/]" with a loopback HOST (the node API itself is plain HTTP on loopback),
// or "https://HOST[:PORT][/]" for the ingress.
Result<ApiAddress> parse_api_address(std::string_view text);
// The inverse, for messages: "unix:/run/sandgate/node.sock", "http://127.0.0.1:8081",
// "https://api.sandbox.localhost:8443".
std::string api_address_string(const ApiAddress& address);

// What the ingress needs on top of the address.
struct IngressAccess {
  std::string token;                  // sent as "Authorization: Bearer" when set
  std::string cacert;                 // https: the CA file; empty = the system's trust store
  std::optional<Ingress> connect_to;  // https: dial this instead of the URL's host (still verified as that host)
  std::vector<HttpHeader> headers;    // sent with every request, after the client's own
};

struct ApiResponse {
  int status = 0;
  std::string body;
};

// The exact bytes sent for one request. A null `body` sends no body (Content-Length: 0 for POST); an empty
// `token` sends no Authorization header. kInvalidArgument for a target or token that could split a line,
// kLimitExceeded for a body over the node's 1 MiB (build_http_request's limits).
Result<std::string> build_request(std::string_view method, std::string_view target, const ApiAddress& address,
                                  std::string_view token, const nlohmann::json& body,
                                  const std::vector<HttpHeader>& headers = {});

class ApiClient {
 public:
  // timeout_ms bounds the whole exchange (connect, handshake, send, wait for and read the answer).
  ApiClient(ApiAddress address, int timeout_ms, IngressAccess access = {})
      : address_(std::move(address)), timeout_ms_(timeout_ms), access_(std::move(access)) {}

  // Any HTTP status is a success here; failures are only about reaching the node and reading its answer:
  // kUnavailable (cannot connect, connection dropped, certificate not trusted), kTimeout, kIo (malformed
  // answer), kInvalidArgument (a token or target that cannot go in a request line or header, an unreadable CA
  // file), kLimitExceeded (a body over the node's 1 MiB). `reached`, when given, says whether the connection
  // (and handshake) succeeded, so the request may have been acted on: a caller that retries elsewhere
  // (fleet placement) does so only when it was not.
  Result<ApiResponse> request(std::string_view method, std::string_view target,
                              const nlohmann::json& body = nullptr, bool* reached = nullptr) const;
  // A streamed answer (POST /v1/images/build): the body of a 2xx answer goes line by line to `on_line` as it
  // arrives, until the node closes the connection (the body is then empty in the result); any other status
  // comes back whole, as from request(). `timeout_ms` bounds the whole stream, instead of the client's own.
  Result<ApiResponse> stream(std::string_view method, std::string_view target, const nlohmann::json& body,
                             int timeout_ms, const std::function<void(std::string_view)>& on_line) const;

 private:
  // The request's bytes, after the token is checked to fit a header line (both request() and stream()).
  Result<std::string> prepare(std::string_view method, std::string_view target, const nlohmann::json& body) const;
  // How an https API address is dialled and verified.
  TlsClientOptions tls_options() const;
  ApiAddress address_;
  int timeout_ms_;
  IngressAccess access_;
};

}  // namespace sg
