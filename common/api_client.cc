#include "common/api_client.h"

#include <chrono>

#include "common/http_client.h"

namespace sg {
namespace {

// A list of every sandbox on a busy node is the largest answer; max_sandboxes can reach a million.
constexpr size_t kMaxResponseBody = 256u * 1024 * 1024;
constexpr uint16_t kHttpsPort = 443;

HttpByteStream tls_stream(SSL* ssl, int fd, Clock::time_point deadline) {
  HttpByteStream s;
  s.write_all = [=](std::string_view data) {
    return ssl_write_all(ssl, fd, data, deadline, "sending the request to the ingress");
  };
  s.read_some = [=](char* buf, size_t cap) {
    return ssl_read_some(ssl, fd, buf, cap, deadline, "reading the answer from the ingress");
  };
  return s;
}

// Sends `req` and reads one HTTP/1.1 answer, worded for the CLI's user. Timeouts come back as they are, for
// the caller to word.
Result<ApiResponse> exchange(const HttpByteStream& stream, const std::string& req, const std::string& where) {
  HttpResponseReader reader({.max_head_bytes = 64 * 1024, .max_body_bytes = kMaxResponseBody});
  if (http_exchange(stream, req, reader)) return ApiResponse{reader.message().status, std::move(reader.message().body)};
  const Failure& f = reader.failure();
  switch (reader.error()) {
    case HttpResponseError::kTimeout: return f;
    case HttpResponseError::kClosedBeforeResponse:
      return fail(Error::kUnavailable, "the server at " + where + " closed the connection without answering: " +
                                           std::string(kCheckApiHint));
    case HttpResponseError::kIo:
      return fail(Error::kUnavailable, "talking to sandgate-node at " + where + " failed: " + f.message);
    default:
      return fail(Error::kIo, "bad answer from " + where + " (" + f.message + "): " + std::string(kCheckApiHint));
  }
}

// The streamed answer of ApiClient::stream: the head, then lines until the peer closes (a close-delimited
// body: the node sends no length for a stream). An error answer (with its Content-Length, then closed) is
// read whole, as small as any other.
Result<ApiResponse> read_stream(const HttpByteStream& stream, const std::string& req, const std::string& where,
                                const std::function<void(std::string_view)>& on_line) {
  constexpr size_t kMaxHead = 64 * 1024, kMaxErrorBody = 1024 * 1024, kMaxLine = 1024 * 1024;
  if (auto s = stream.write_all(req); !s) return s.failure();
  std::string buf;
  char chunk[16 * 1024];
  size_t head_end = std::string::npos;
  while (head_end == std::string::npos) {
    auto n = stream.read_some(chunk, sizeof chunk);
    if (!n) return n.failure();
    if (*n == 0)
      return fail(Error::kUnavailable, "the server at " + where + " closed the connection without answering: " +
                                           std::string(kCheckApiHint));
    buf.append(chunk, *n);
    head_end = buf.find("\r\n\r\n");
    if (head_end == std::string::npos && buf.size() > kMaxHead)
      return fail(Error::kIo, "bad answer from " + where + " (head too long): " + std::string(kCheckApiHint));
  }
  int status = 0;
  if (!buf.starts_with("HTTP/1.") || buf.size() < 12 || std::sscanf(buf.c_str() + 9, "%3d", &status) != 1)
    return fail(Error::kIo, "bad answer from " + where + " (no HTTP status line): " + std::string(kCheckApiHint));
  std::string rest = buf.substr(head_end + 4);
  const bool ok = status >= 200 && status <= 299;
  std::string line;
  auto feed = [&](std::string_view data) -> Status {
    for (char c : data) {
      if (c != '\n') {
        if (line.size() >= kMaxLine) return fail(Error::kIo, "bad answer from " + where + " (a line over 1 MiB)");
        line.push_back(c);
        continue;
      }
      on_line(line);
      line.clear();
    }
    return {};
  };
  if (ok) {
    if (auto s = feed(rest); !s) return s.failure();
    rest.clear();
  }
  for (;;) {
    auto n = stream.read_some(chunk, sizeof chunk);
    if (!n) return n.failure();
    if (*n == 0) break;
    if (ok) {
      if (auto s = feed(std::string_view(chunk, *n)); !s) return s.failure();
    } else if (rest.size() < kMaxErrorBody) {
      rest.append(chunk, *n);
    }
  }
  if (ok && !line.empty()) on_line(line);
  return ApiResponse{status, ok ? std::string() : std::move(rest)};
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

Result<std::string> build_request(std::string_view method, std::string_view target, const ApiAddress& address,
                                  std::string_view token, const nlohmann::json& body,
                                  const std::vector<HttpHeader>& headers) {
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
  HttpRequest req{.method = method, .target = target, .host = host, .headers = {}, .body = payload};
  if (!token.empty()) req.headers.push_back({"Authorization", "Bearer " + std::string(token)});
  req.headers.push_back({"User-Agent", "sandgate-cli"});
  req.headers.push_back({"Accept", "application/json"});
  req.headers.push_back({"Connection", "close"});
  if (!body.is_null()) req.headers.push_back({"Content-Type", "application/json"});
  req.headers.insert(req.headers.end(), headers.begin(), headers.end());
  // Content-Length always goes, even when 0: a POST without a length is ambiguous to some servers.
  return build_http_request(req);
}

Result<ApiResponse> ApiClient::request(std::string_view method, std::string_view target,
                                       const nlohmann::json& body, bool* reached) const {
  if (reached != nullptr) *reached = false;
  const std::string where = api_address_string(address_);
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms_);
  // Every timeout, whichever step it hit, reads the same: the user only set one limit.
  auto worded = [&](const Failure& f) {
    if (f.code != Error::kTimeout) return f;
    std::string limit = timeout_ms_ % 1000 == 0 ? std::to_string(timeout_ms_ / 1000) + " s"
                                                : std::to_string(timeout_ms_) + " ms";
    return fail(Error::kTimeout, "sandgate-node at " + where + " did not answer within " + limit);
  };
  auto req = prepare(method, target, body);
  if (!req) return req.failure();

  if (address_.kind == ApiAddress::Kind::kHttps) {
    auto conn = tls_connect(tls_options(), deadline);
    if (!conn) {
      if (conn.error() != Error::kUnavailable) return worded(conn.failure());
      return fail(conn.error(), "cannot reach sandgate-node at " + where + ": " + conn.message());
    }
    if (reached != nullptr) *reached = true;
    auto res = exchange(tls_stream(conn->ssl.get(), conn->sock.get(), deadline), *req, where);
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
  if (reached != nullptr) *reached = true;
  auto res = exchange(http_fd_stream(fd->get(), deadline), *req, where);
  return res ? res : Result<ApiResponse>(worded(res.failure()));
}

}  // namespace sg

namespace sg {

Result<std::string> ApiClient::prepare(std::string_view method, std::string_view target,
                                      const nlohmann::json& body) const {
  if (!access_.token.empty() && !token_fits_header(access_.token))
    return fail(Error::kInvalidArgument, "the token is malformed (one line, no spaces)");
  return build_request(method, target, address_, access_.token, body, access_.headers);
}

TlsClientOptions ApiClient::tls_options() const {
  return TlsClientOptions{access_.connect_to.value_or(address_.server), address_.server.host, access_.cacert,
                          "fix the URL in --api / SANDGATE_API, or dial another address with --connect-to / "
                          "SANDGATE_INGRESS"};
}

Result<ApiResponse> ApiClient::stream(std::string_view method, std::string_view target, const nlohmann::json& body,
                                      int timeout_ms, const std::function<void(std::string_view)>& on_line) const {
  const std::string where = api_address_string(address_);
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  auto req = prepare(method, target, body);
  if (!req) return req.failure();
  if (address_.kind == ApiAddress::Kind::kHttps) {
    auto conn = tls_connect(tls_options(), deadline);
    if (!conn) return fail(conn.error(), "cannot reach sandgate-node at " + where + ": " + conn.message());
    return read_stream(tls_stream(conn->ssl.get(), conn->sock.get(), deadline), *req, where, on_line);
  }
  auto fd = connect_blocking(address_.endpoint, timeout_ms_);
  if (!fd)
    return fail(fd.error() == Error::kTimeout ? Error::kTimeout : Error::kUnavailable,
                "cannot reach sandgate-node at " + where + ": " + fd.message() + ". " + std::string(kNodeDownHint));
  return read_stream(http_fd_stream(fd->get(), deadline), *req, where, on_line);
}

}  // namespace sg
