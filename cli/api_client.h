// A small blocking HTTP/1.1 client for the sandgate-node API (docs/node-api.md), used by the `sandgate` CLI.
// One request per connection: the CLI makes one call per run, so keep-alive would buy nothing.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <string_view>
#include <utility>

#include "common/error.h"
#include "common/net.h"

namespace sg::cli {

inline constexpr std::string_view kDefaultApi = "unix:/run/sandgate/node.sock";

// "unix:/path" or "http://HOST:PORT[/]" with a loopback HOST; the node API is plain HTTP, so https is refused.
Result<Endpoint> parse_api_address(std::string_view text);
// The inverse, for messages: "unix:/run/sandgate/node.sock" or "http://127.0.0.1:8081".
std::string api_address_string(const Endpoint& ep);

struct ApiResponse {
  int status = 0;
  std::string body;
};

// The exact bytes sent for one request. A null `body` sends no body (Content-Length: 0 for POST).
std::string build_request(std::string_view method, std::string_view target, const Endpoint& ep,
                          const nlohmann::json& body);

class ApiClient {
 public:
  // timeout_ms bounds the whole exchange (connect, send, wait for and read the answer).
  ApiClient(Endpoint endpoint, int timeout_ms) : endpoint_(std::move(endpoint)), timeout_ms_(timeout_ms) {}

  // Any HTTP status is a success here; failures are only about reaching the node and reading its answer:
  // kUnavailable (cannot connect, connection dropped), kTimeout, kIo (malformed answer).
  Result<ApiResponse> request(std::string_view method, std::string_view target,
                              const nlohmann::json& body = nullptr) const;

 private:
  Endpoint endpoint_;
  int timeout_ms_;
};

}  // namespace sg::cli
