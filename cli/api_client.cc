#include "cli/api_client.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "common/http.h"

namespace sg::cli {
namespace {

using Clock = std::chrono::steady_clock;

// A list of every sandbox on a busy node is the largest answer; max_sandboxes can reach a million.
constexpr size_t kMaxResponseBody = 256u * 1024 * 1024;

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left > 0 ? static_cast<int>(left) : 0;
}

// Waits for `events` on fd until the deadline. false = timed out.
Result<bool> wait_for(int fd, short events, Clock::time_point deadline) {
  while (true) {
    pollfd p{fd, events, 0};
    int n = ::poll(&p, 1, remaining_ms(deadline));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) return fail_errno("poll", errno);
  }
}

}  // namespace

Result<Endpoint> parse_api_address(std::string_view text) {
  static constexpr std::string_view kExpected = "expected unix:/path or http://127.0.0.1:PORT";
  auto bad = [&](std::string_view why) {
    return fail(Error::kInvalidArgument,
                "invalid node API address '" + std::string(text) + "': " + std::string(why));
  };
  if (text.starts_with("unix:")) {
    auto ep = parse_endpoint(text);
    if (!ep) return bad(ep.message());
    if (!ep->path.starts_with("/")) return bad("the socket path must be absolute");
    return ep;
  }
  if (text.starts_with("https://")) return bad("the node API is plain HTTP on loopback, use http://");
  if (!text.starts_with("http://")) return bad(kExpected);
  std::string_view hostport = text.substr(7);
  if (hostport.ends_with("/")) hostport.remove_suffix(1);
  if (hostport.find('/') != std::string_view::npos) return bad("no path allowed after host:port");
  auto ep = parse_endpoint(hostport);
  if (!ep) return bad(ep.message());
  if (ep->port == 0) return bad("port must be 1-65535");
  return ep;
}

std::string api_address_string(const Endpoint& ep) {
  return ep.kind == Endpoint::Kind::kUnix ? ep.to_string() : "http://" + ep.to_string();
}

std::string build_request(std::string_view method, std::string_view target, const Endpoint& ep,
                          const nlohmann::json& body) {
  std::string payload;
  // replace: a non-UTF-8 argument (an env value, say) must not make dump() throw.
  if (!body.is_null()) payload = body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::string req;
  req.reserve(256 + payload.size());
  req.append(method).append(" ").append(target).append(" HTTP/1.1\r\n");
  req.append("Host: ").append(ep.kind == Endpoint::Kind::kUnix ? "localhost" : ep.to_string()).append("\r\n");
  req.append("User-Agent: sandgate-cli\r\nAccept: application/json\r\nConnection: close\r\n");
  if (!body.is_null()) req.append("Content-Type: application/json\r\n");
  // Always sent, even when 0: a POST without a length is ambiguous to some servers.
  req.append("Content-Length: ").append(std::to_string(payload.size())).append("\r\n\r\n");
  req.append(payload);
  return req;
}

Result<ApiResponse> ApiClient::request(std::string_view method, std::string_view target,
                                       const nlohmann::json& body) const {
  const std::string where = api_address_string(endpoint_);
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms_);
  auto timed_out = [&] {
    std::string limit = timeout_ms_ % 1000 == 0 ? std::to_string(timeout_ms_ / 1000) + " s"
                                                : std::to_string(timeout_ms_) + " ms";
    return fail(Error::kTimeout, "sandgate-node at " + where + " did not answer within " + limit);
  };

  auto fd = connect_blocking(endpoint_, timeout_ms_);
  if (!fd) {
    // connect_blocking says "connect <endpoint>: <strerror>"; the user needs the address and the reason once.
    std::string reason = fd.message();
    const std::string prefix = "connect " + endpoint_.to_string() + ": ";
    if (reason.starts_with(prefix)) reason.erase(0, prefix.size());
    Error code = fd.error() == Error::kTimeout ? Error::kTimeout : Error::kUnavailable;
    return fail(code, "cannot reach sandgate-node at " + where + ": " + reason);
  }

  const std::string req = build_request(method, target, endpoint_, body);
  size_t sent = 0;
  while (sent < req.size()) {
    auto ready = wait_for(fd->get(), POLLOUT, deadline);
    if (!ready) return ready.failure();
    if (!*ready) return timed_out();
    // MSG_NOSIGNAL: a node that went away must produce an error message, not kill the CLI with SIGPIPE.
    ssize_t n = ::send(fd->get(), req.data() + sent, req.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return fail(Error::kUnavailable,
                  "sending to sandgate-node at " + where + " failed: " + std::strerror(errno));
    }
    sent += static_cast<size_t>(n);
  }

  HttpParser parser(HttpParser::Kind::kResponse, HttpLimits{.max_head_bytes = 64 * 1024,
                                                            .max_body_bytes = kMaxResponseBody,
                                                            .stop_after_head = false});
  char buf[64 * 1024];
  HttpParser::State state = HttpParser::State::kNeedMore;
  bool got_bytes = false;
  while (state == HttpParser::State::kNeedMore) {
    auto ready = wait_for(fd->get(), POLLIN, deadline);
    if (!ready) return ready.failure();
    if (!*ready) return timed_out();
    ssize_t n = ::recv(fd->get(), buf, sizeof buf, MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return fail(Error::kUnavailable,
                  "reading from sandgate-node at " + where + " failed: " + std::strerror(errno));
    }
    if (n == 0) {
      if (!got_bytes)
        return fail(Error::kUnavailable, "sandgate-node at " + where + " closed the connection without answering");
      state = parser.finish();
    } else {
      got_bytes = true;
      state = parser.feed(buf, static_cast<size_t>(n));
    }
  }
  if (state == HttpParser::State::kError)
    return fail(Error::kIo, "bad answer from sandgate-node at " + where + ": " + parser.failure().message);
  return ApiResponse{parser.message().status, std::move(parser.message().body)};
}

}  // namespace sg::cli
