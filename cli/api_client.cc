#include "cli/api_client.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>

#include "cli/ssh.h"
#include "common/http.h"

namespace sg::cli {
namespace {

// A list of every sandbox on a busy node is the largest answer; max_sandboxes can reach a million.
constexpr size_t kMaxResponseBody = 256u * 1024 * 1024;
constexpr uint16_t kHttpsPort = 443;

// One connection's bytes, plain or TLS, so that exchange() below is the only HTTP code. Both functions
// honour the request's deadline (kTimeout past it); read_some returns 0 at the end of the stream.
struct Stream {
  std::function<Status(std::string_view)> write_all;
  std::function<Result<size_t>(char*, size_t)> read_some;
};

Stream plain_stream(int fd, Clock::time_point deadline, const std::string& where) {
  Stream s;
  s.write_all = [=](std::string_view data) -> Status {
    while (!data.empty()) {
      if (auto ready = wait_fd(fd, POLLOUT, deadline, "sending"); !ready) return ready;
      // MSG_NOSIGNAL: a node that went away must produce an error message, not kill the CLI with SIGPIPE.
      ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
        return fail(Error::kUnavailable, "sending to sandgate-node at " + where + " failed: " + std::strerror(errno));
      }
      data.remove_prefix(static_cast<size_t>(n));
    }
    return {};
  };
  s.read_some = [=](char* buf, size_t cap) -> Result<size_t> {
    for (;;) {
      if (auto ready = wait_fd(fd, POLLIN, deadline, "reading"); !ready) return ready.failure();
      ssize_t n = ::recv(fd, buf, cap, MSG_DONTWAIT);
      if (n >= 0) return static_cast<size_t>(n);
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return fail(Error::kUnavailable, "reading from sandgate-node at " + where + " failed: " + std::strerror(errno));
    }
  };
  return s;
}

Stream tls_stream(SSL* ssl, int fd, Clock::time_point deadline) {
  Stream s;
  s.write_all = [=](std::string_view data) {
    return ssl_write_all(ssl, fd, data, deadline, "sending the request to the ingress");
  };
  s.read_some = [=](char* buf, size_t cap) {
    return ssl_read_some(ssl, fd, buf, cap, deadline, "reading the answer from the ingress");
  };
  return s;
}

// Sends `req` and reads one HTTP/1.1 answer. Timeouts come back as they are, for the caller to word.
Result<ApiResponse> exchange(const Stream& stream, const std::string& req, const std::string& where) {
  if (auto s = stream.write_all(req); !s) return s.failure();
  HttpParser parser(HttpParser::Kind::kResponse, HttpLimits{.max_head_bytes = 64 * 1024,
                                                            .max_body_bytes = kMaxResponseBody,
                                                            .stop_after_head = false});
  std::string buf(64 * 1024, '\0');
  HttpParser::State state = HttpParser::State::kNeedMore;
  bool got_bytes = false;
  while (state == HttpParser::State::kNeedMore) {
    auto n = stream.read_some(buf.data(), buf.size());
    if (!n) return n.failure();
    if (*n == 0) {
      if (!got_bytes)
        return fail(Error::kUnavailable, "the server at " + where + " closed the connection without answering: " +
                                             std::string(kCheckApiHint));
      state = parser.finish();
    } else {
      got_bytes = true;
      state = parser.feed(buf.data(), *n);
    }
  }
  if (state == HttpParser::State::kError)
    return fail(Error::kIo, "bad answer from " + where + " (" + parser.failure().message +
                                "): " + std::string(kCheckApiHint));
  return ApiResponse{parser.message().status, std::move(parser.message().body)};
}

}  // namespace

Result<ApiAddress> parse_api_address(std::string_view text) {
  static constexpr std::string_view kExpected =
      "expected unix:/path, http://127.0.0.1:PORT or https://api.DOMAIN[:PORT]";
  auto bad = [&](std::string_view why) {
    return fail(Error::kInvalidArgument,
                "invalid node API address '" + std::string(text) + "': " + std::string(why));
  };
  ApiAddress out;
  if (text.starts_with("unix:")) {
    auto ep = parse_endpoint(text);
    if (!ep) return bad(ep.message());
    if (!ep->path.starts_with("/")) return bad("the socket path must be absolute");
    out.endpoint = std::move(*ep);
    return out;
  }
  const bool https = text.starts_with("https://");
  if (!https && !text.starts_with("http://")) return bad(kExpected);
  std::string_view hostport = text.substr(https ? 8 : 7);
  if (hostport.ends_with("/")) hostport.remove_suffix(1);
  if (hostport.find('/') != std::string_view::npos) return bad("no path allowed after host:port");
  if (https) {
    // The port is optional in an https URL; "[::1]" holds colons of its own.
    size_t colon = hostport.rfind(':'), bracket = hostport.rfind(']');
    bool has_port = colon != std::string_view::npos && (bracket == std::string_view::npos || colon > bracket);
    std::string with_port(hostport);
    if (!has_port) with_port += ":" + std::to_string(kHttpsPort);
    auto server = parse_ingress(with_port);
    if (!server) return bad(server.message());
    out.kind = ApiAddress::Kind::kHttps;
    out.server = std::move(*server);
    return out;
  }
  auto ep = parse_endpoint(hostport);
  if (!ep) return bad(ep.message() + " (the node API is plain HTTP on loopback; use https:// for the ingress)");
  if (ep->port == 0) return bad("port must be 1-65535");
  out.endpoint = std::move(*ep);
  return out;
}

std::string api_address_string(const ApiAddress& address) {
  if (address.kind == ApiAddress::Kind::kHttps) {
    const std::string& host = address.server.host;
    bool v6 = host.find(':') != std::string::npos;
    return "https://" + (v6 ? "[" + host + "]" : host) + ":" + std::to_string(address.server.port);
  }
  const Endpoint& ep = address.endpoint;
  return ep.kind == Endpoint::Kind::kUnix ? ep.to_string() : "http://" + ep.to_string();
}

std::string build_request(std::string_view method, std::string_view target, const ApiAddress& address,
                          std::string_view token, const nlohmann::json& body) {
  std::string payload;
  // replace: a non-UTF-8 argument (an env value, say) must not make dump() throw.
  if (!body.is_null()) payload = body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::string host;
  if (address.kind == ApiAddress::Kind::kHttps) {
    // The ingress routes on this name, so it is the URL's, whatever address was dialed.
    host = api_address_string(address).substr(8);
  } else {
    host = address.endpoint.kind == Endpoint::Kind::kUnix ? "localhost" : address.endpoint.to_string();
  }
  std::string req;
  req.reserve(256 + payload.size());
  req.append(method).append(" ").append(target).append(" HTTP/1.1\r\n");
  req.append("Host: ").append(host).append("\r\n");
  if (!token.empty()) req.append("Authorization: Bearer ").append(token).append("\r\n");
  req.append("User-Agent: sandgate-cli\r\nAccept: application/json\r\nConnection: close\r\n");
  if (!body.is_null()) req.append("Content-Type: application/json\r\n");
  // Always sent, even when 0: a POST without a length is ambiguous to some servers.
  req.append("Content-Length: ").append(std::to_string(payload.size())).append("\r\n\r\n");
  req.append(payload);
  return req;
}

Result<ApiResponse> ApiClient::request(std::string_view method, std::string_view target,
                                       const nlohmann::json& body) const {
  const std::string where = api_address_string(address_);
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms_);
  // Every timeout, whichever step it hit, reads the same: the user only set one limit.
  auto worded = [&](const Failure& f) {
    if (f.code != Error::kTimeout) return f;
    std::string limit = timeout_ms_ % 1000 == 0 ? std::to_string(timeout_ms_ / 1000) + " s"
                                                : std::to_string(timeout_ms_) + " ms";
    return fail(Error::kTimeout, "sandgate-node at " + where + " did not answer within " + limit);
  };
  if (!access_.token.empty() && !token_fits_header(access_.token))
    return fail(Error::kInvalidArgument, "the token is malformed (one line, no spaces)");
  const std::string req = build_request(method, target, address_, access_.token, body);

  if (address_.kind == ApiAddress::Kind::kHttps) {
    TlsClientOptions tls{access_.connect_to.value_or(address_.server), address_.server.host, access_.cacert,
                         "fix the URL in --api / SANDGATE_API, or dial another address with --connect-to / "
                         "SANDGATE_INGRESS"};
    auto conn = tls_connect(tls, deadline);
    if (!conn) {
      if (conn.error() != Error::kUnavailable) return worded(conn.failure());
      return fail(conn.error(), "cannot reach sandgate-node at " + where + ": " + conn.message());
    }
    auto res = exchange(tls_stream(conn->ssl.get(), conn->sock.get(), deadline), req, where);
    return res ? res : Result<ApiResponse>(worded(res.failure()));
  }

  auto fd = connect_blocking(address_.endpoint, timeout_ms_);
  if (!fd) {
    // connect_blocking says "connect <endpoint>: <strerror>"; the user needs the address and the reason once.
    std::string reason = fd.message();
    const std::string prefix = "connect " + address_.endpoint.to_string() + ": ";
    if (reason.starts_with(prefix)) reason.erase(0, prefix.size());
    Error code = fd.error() == Error::kTimeout ? Error::kTimeout : Error::kUnavailable;
    return fail(code, "cannot reach sandgate-node at " + where + ": " + reason + ". " + std::string(kNodeDownHint));
  }
  auto res = exchange(plain_stream(fd->get(), deadline, where), req, where);
  return res ? res : Result<ApiResponse>(worded(res.failure()));
}

}  // namespace sg::cli
