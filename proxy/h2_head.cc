#include "proxy/h2_head.h"

#include <nghttp2/nghttp2.h>

#include <algorithm>
#include <memory>

#include "proxy/edge_auth.h"

namespace sg {
namespace h2 {

namespace {

uint8_t byte_at(std::string_view s, size_t i) { return static_cast<uint8_t>(s[i]); }

// RFC 9110 tchar, lowercase only: HTTP/2 field names must not contain uppercase letters (RFC 9113 §8.2.1).
bool is_lower_token_char(char c) {
  if ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9')) return true;
  return std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

bool equals_ignore_case(std::string_view a, std::string_view b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](char x, char y) {
    auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; };
    return lower(x) == lower(y);
  });
}

}  // namespace

FrameHeader read_frame_header(std::string_view s) {
  FrameHeader h;
  h.length = (uint32_t{byte_at(s, 0)} << 16) | (uint32_t{byte_at(s, 1)} << 8) | byte_at(s, 2);
  h.type = byte_at(s, 3);
  h.flags = byte_at(s, 4);
  // The top bit is reserved and must be ignored on receipt.
  h.stream_id = ((uint32_t{byte_at(s, 5)} << 24) | (uint32_t{byte_at(s, 6)} << 16) |
                 (uint32_t{byte_at(s, 7)} << 8) | byte_at(s, 8)) & kMaxStreamId;
  return h;
}

void append_u32(std::string& out, uint32_t v) {
  out.push_back(static_cast<char>(v >> 24));
  out.push_back(static_cast<char>(v >> 16));
  out.push_back(static_cast<char>(v >> 8));
  out.push_back(static_cast<char>(v));
}

void append_frame(std::string& out, uint8_t type, uint8_t flags, uint32_t stream_id, std::string_view payload) {
  const auto length = static_cast<uint32_t>(payload.size());
  out.push_back(static_cast<char>(length >> 16));
  out.push_back(static_cast<char>(length >> 8));
  out.push_back(static_cast<char>(length));
  out.push_back(static_cast<char>(type));
  out.push_back(static_cast<char>(flags));
  append_u32(out, stream_id);
  out.append(payload);
}

void append_header_block(std::string& out, uint32_t stream_id, bool end_stream, std::string_view block) {
  bool first = true;
  do {
    const std::string_view fragment = block.substr(0, kDefaultMaxFrameBytes);
    block.remove_prefix(fragment.size());
    const uint8_t end_headers = block.empty() ? kFlagEndHeaders : 0;
    if (first) {
      append_frame(out, kHeaders, static_cast<uint8_t>((end_stream ? kFlagEndStream : 0) | end_headers), stream_id,
                   fragment);
    } else {
      append_frame(out, kContinuation, end_headers, stream_id, fragment);
    }
    first = false;
  } while (!block.empty());
}

std::string_view frame_name(uint8_t type) {
  switch (type) {
    case kData: return "DATA";
    case kHeaders: return "HEADERS";
    case kPriority: return "PRIORITY";
    case kRstStream: return "RST_STREAM";
    case kSettings: return "SETTINGS";
    case kPushPromise: return "PUSH_PROMISE";
    case kPing: return "PING";
    case kGoaway: return "GOAWAY";
    case kWindowUpdate: return "WINDOW_UPDATE";
    case kContinuation: return "CONTINUATION";
    default: return "unknown";
  }
}

Failure protocol_error(std::string message) { return fail(Error::kInvalidArgument, "HTTP/2: " + std::move(message)); }

Failure not_a_preface(char first_byte) {
  // An uppercase letter first is most likely an HTTP/1 method from a client that ignored the ALPN result.
  const bool looks_like_http1 = first_byte >= 'A' && first_byte <= 'Z';
  return protocol_error(std::string("not an HTTP/2 connection preface") +
                        (looks_like_http1 ? " (an HTTP/1 request on a connection that negotiated h2?)" : ""));
}

Status check_field_name(std::string_view name) {
  if (name.empty()) return protocol_error("empty field name");
  bool uppercase = false;
  for (char c : name) {
    if (c >= 'A' && c <= 'Z') uppercase = true;
    else if (!is_lower_token_char(c)) return protocol_error("field name has a character HTTP/2 forbids");
  }
  // Named only once it is known to be a token: the message reaches the client in a 400 and the access log.
  if (uppercase)
    return protocol_error("field name '" + std::string(name) + "' has uppercase letters, which HTTP/2 forbids");
  return {};
}

// RFC 9113 §8.2.1: no NUL, CR or LF anywhere, no whitespace at either end. Values that break these rules are
// read differently by different implementations, which is exactly what an edge that authenticates must avoid.
Status check_field_value(std::string_view name, std::string_view value) {
  if (value.find_first_of(std::string_view("\0\r\n", 3)) != std::string_view::npos)
    return protocol_error("value of '" + std::string(name) + "' contains NUL, CR or LF");
  if (!value.empty() && (value.front() == ' ' || value.front() == '\t' || value.back() == ' ' || value.back() == '\t'))
    return protocol_error("value of '" + std::string(name) + "' starts or ends with whitespace");
  return {};
}

// RFC 9113 §8.2.2: HTTP/1.1 connection-level fields have no meaning in HTTP/2 and make a message malformed.
bool is_connection_specific(std::string_view lowercase_name) {
  for (std::string_view n : {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"})
    if (lowercase_name == n) return true;
  return false;
}

void InflaterDeleter::operator()(nghttp2_hd_inflater* p) const { nghttp2_hd_inflate_del(p); }
void DeflaterDeleter::operator()(nghttp2_hd_deflater* p) const { nghttp2_hd_deflate_del(p); }

Status RequestBuilder::add(std::string_view name, std::string_view value) {
  if (!name.empty() && name.front() == ':') return add_pseudo(name, value);
  regular_seen_ = true;
  if (Status s = check_field_name(name); !s) return s;
  if (Status s = check_field_value(name, value); !s) return s;
  if (is_connection_specific(name))
    return protocol_error("connection-specific field '" + std::string(name) + "' is not allowed");
  if (name == "te" && value != "trailers") return protocol_error("te may only be \"trailers\"");
  if (name == "host") host_values_.emplace_back(value);
  if (name == "cookie") {
    if (cookie_index_) {
      request_.headers[*cookie_index_].value.append("; ").append(value);
      return {};
    }
    cookie_index_ = request_.headers.size();
  }
  request_.headers.push_back({std::string(name), std::string(value)});
  return {};
}

Result<H2Request> RequestBuilder::finish() && {
  if (!method_seen_) return protocol_error("request has no :method");
  // A plain CONNECT asks for a tunnel to its :authority, which the proxy does not offer over HTTP/2. The
  // extended CONNECT of RFC 8441 (WebSockets over HTTP/2) names a resource like any request (:scheme and :path
  // are required, §4), so it is routed, authenticated and checked like one.
  if (request_.method == "CONNECT" && !protocol_seen_) return protocol_error("CONNECT requests are not served");
  if (protocol_seen_ && request_.method != "CONNECT")
    return protocol_error(":protocol is only allowed in an extended CONNECT (RFC 8441), not with :method " +
                          request_.method);
  if (!scheme_seen_) return protocol_error("request has no :scheme");
  if (!path_seen_) return protocol_error("request has no :path");
  if (request_.path.front() != '/' && !(request_.path == "*" && request_.method == "OPTIONS"))
    return protocol_error(":path must start with '/'");
  if (!authority_seen_) {
    return protocol_error(host_values_.empty() ? "request has no :authority"
                                               : "request names its host in Host, not :authority");
  }
  // The proxy routes on :authority while the application may read Host: both must name the same host.
  for (const std::string& host : host_values_)
    if (!equals_ignore_case(host, request_.authority)) return protocol_error("Host differs from :authority");
  return std::move(request_);
}

Status RequestBuilder::add_pseudo(std::string_view name, std::string_view value) {
  if (regular_seen_) return protocol_error("pseudo-header " + std::string(name) + " after a regular field");
  std::string* target = nullptr;
  bool* seen = nullptr;
  if (name == ":method") target = &request_.method, seen = &method_seen_;
  else if (name == ":scheme") target = &request_.scheme, seen = &scheme_seen_;
  else if (name == ":authority") target = &request_.authority, seen = &authority_seen_;
  else if (name == ":path") target = &request_.path, seen = &path_seen_;
  else if (name == ":protocol") target = &request_.protocol, seen = &protocol_seen_;
  // :status belongs to responses.
  else return protocol_error("pseudo-header " + std::string(name) + " is not allowed in a request");
  if (*seen) return protocol_error("duplicate " + std::string(name));
  if (value.empty()) return protocol_error(std::string(name) + " is empty");
  if (Status s = check_field_value(name, value); !s) return s;
  // Both are tokens: a method (RFC 9110 §9.1) and an Upgrade protocol name (RFC 8441 §4, RFC 9110 §7.8).
  if ((name == ":method" || name == ":protocol") && !std::all_of(value.begin(), value.end(), [](char c) {
        return is_lower_token_char(c) || (c >= 'A' && c <= 'Z');
      }))
    return protocol_error(std::string(name) + " is not a token");
  *seen = true;
  target->assign(value);
  return {};
}

Status inflate_header_block(nghttp2_hd_inflater* inflater, std::string_view block, size_t max_list_bytes,
                            const FieldSink& on_field) {
  const auto* in = reinterpret_cast<const uint8_t*>(block.data());
  size_t left = block.size();
  size_t list_bytes = 0;
  for (;;) {
    nghttp2_nv nv{};
    int flags = 0;
    ssize_t used = nghttp2_hd_inflate_hd2(inflater, &nv, &flags, in, left, /*in_final=*/1);
    if (used < 0) {
      if (used == NGHTTP2_ERR_NOMEM) return fail(Error::kInternal, "HPACK decoder: out of memory");
      return protocol_error("HPACK decoding failed: " + std::string(nghttp2_strerror(static_cast<int>(used))));
    }
    in += used;
    left -= static_cast<size_t>(used);
    if (flags & NGHTTP2_HD_INFLATE_EMIT) {
      list_bytes += nv.namelen + nv.valuelen + kFieldOverheadBytes;
      if (list_bytes > max_list_bytes)
        return fail(Error::kLimitExceeded,
                    "HTTP/2: header list exceeds " + std::to_string(max_list_bytes) + " bytes");
      Status added = on_field(std::string_view(reinterpret_cast<const char*>(nv.name), nv.namelen),
                              std::string_view(reinterpret_cast<const char*>(nv.value), nv.valuelen));
      if (!added) return added;
    }
    if (flags & NGHTTP2_HD_INFLATE_FINAL) break;
    if (!(flags & NGHTTP2_HD_INFLATE_EMIT) && left == 0) return protocol_error("HPACK block ends mid-field");
  }
  // Resets the per-block decoding state; the dynamic table stays for the next block.
  nghttp2_hd_inflate_end_headers(inflater);
  return {};
}

Result<Result<H2Request>> decode_request(nghttp2_hd_inflater* inflater, uint32_t stream_id, std::string_view block,
                                         size_t max_list_bytes) {
  RequestBuilder builder(stream_id);
  std::optional<Failure> malformed;
  Status decoded = inflate_header_block(inflater, block, max_list_bytes, [&](std::string_view name, std::string_view value) {
    if (malformed) return Status();
    if (Status added = builder.add(name, value); !added) malformed = added.failure();
    return Status();
  });
  if (!decoded) return decoded.failure();
  if (malformed) return Result<H2Request>(*malformed);
  return std::move(builder).finish();
}

Result<std::string_view> headers_fragment(const FrameHeader& h, std::string_view payload) {
  size_t prefix = 0;
  size_t padding = 0;
  if (h.flags & kFlagPadded) {
    if (payload.empty()) return protocol_error("PADDED HEADERS frame without a pad length");
    padding = byte_at(payload, 0);
    prefix = 1;
  }
  if (h.flags & kFlagPriority) prefix += 5;
  if (prefix + padding > payload.size()) return protocol_error("HEADERS padding and priority fields are longer than its payload");
  return payload.substr(prefix, payload.size() - prefix - padding);
}

}  // namespace h2

using namespace h2;  // NOLINT(google-build-using-namespace): the wire vocabulary of this file

namespace {

// SETTINGS_MAX_FRAME_SIZE's initial value. The client cannot have learnt a larger one: the backend's
// SETTINGS only reach it after the scan, and the proxy sends none of its own before forwarding.
constexpr size_t kMaxFrameBytes = kDefaultMaxFrameBytes;
constexpr size_t kMaxGoawayDebugBytes = 1024;

// A fresh inflater per request: the first header block of a connection is decoded from an empty dynamic
// table, exactly as the backend will decode it.
Result<Result<H2Request>> decode_header_block(uint32_t stream_id, std::string_view block, const H2ScanLimits& limits) {
  nghttp2_hd_inflater* raw = nullptr;
  if (nghttp2_hd_inflate_new(&raw) != 0) return fail(Error::kInternal, "HPACK decoder: out of memory");
  InflaterPtr inflater(raw);
  return decode_request(inflater.get(), stream_id, block, limits.max_header_list_bytes);
}

// Checks a frame that may precede the first request; only its shape matters, its content is the backend's.
Status check_preceding_frame(const FrameHeader& h, std::string_view payload) {
  switch (h.type) {
    case kSettings:
      if (h.stream_id != 0) return protocol_error("SETTINGS on a stream");
      if (h.flags & kFlagAck) {
        if (!payload.empty()) return protocol_error("SETTINGS ACK with a payload");
      } else if (payload.size() % 6 != 0) {
        return protocol_error("SETTINGS payload is not a multiple of 6 bytes");
      }
      return {};
    case kPing:
      if (h.stream_id != 0 || payload.size() != 8) return protocol_error("malformed PING");
      return {};
    case kWindowUpdate:
      if (payload.size() != 4) return protocol_error("malformed WINDOW_UPDATE");
      return {};
    case kPriority:
      if (h.stream_id == 0 || payload.size() != 5) return protocol_error("malformed PRIORITY");
      return {};
    case kData:
    case kRstStream:
    case kPushPromise:
    case kGoaway:
      return protocol_error(std::string(frame_name(h.type)) + " frame before the first request");
    default:
      return {};  // extension frame types are ignored (RFC 9113 §5.5); the backend ignores them too
  }
}

Status check_field_for_response(std::string_view name, std::string_view value) {
  if (Status s = check_field_name(name); !s) return s;
  if (is_connection_specific(name)) return protocol_error("connection-specific field '" + std::string(name) + "'");
  if (value.find_first_of(std::string_view("\0\r\n", 3)) != std::string_view::npos)
    return protocol_error("value of '" + std::string(name) + "' contains NUL, CR or LF");
  return {};
}

nghttp2_nv make_nv(const std::string& name, const std::string& value) {
  return nghttp2_nv{reinterpret_cast<uint8_t*>(const_cast<char*>(name.data())),
                    reinterpret_cast<uint8_t*>(const_cast<char*>(value.data())), name.size(), value.size(),
                    NGHTTP2_NV_FLAG_NONE};
}

Result<std::string> hpack_encode(const std::vector<HttpHeader>& fields) {
  nghttp2_hd_deflater* raw = nullptr;
  if (nghttp2_hd_deflate_new(&raw, kDefaultHpackTableBytes) != 0)
    return fail(Error::kInternal, "HPACK encoder: out of memory");
  DeflaterPtr deflater(raw);
  std::vector<nghttp2_nv> nva;
  nva.reserve(fields.size());
  for (const HttpHeader& f : fields) nva.push_back(make_nv(f.name, f.value));
  std::string block(nghttp2_hd_deflate_bound(deflater.get(), nva.data(), nva.size()), '\0');
  ssize_t n = nghttp2_hd_deflate_hd(deflater.get(), reinterpret_cast<uint8_t*>(block.data()), block.size(),
                                    nva.data(), nva.size());
  if (n < 0) return fail(Error::kInternal, "HPACK encoding failed: " + std::string(nghttp2_strerror(static_cast<int>(n))));
  block.resize(static_cast<size_t>(n));
  return block;
}

}  // namespace

Result<std::optional<H2Request>> H2RequestScanner::scan(std::string_view received) {
  auto scanned = scan_frames(received);
  if (!scanned && malformed_stream_ == 0 && goaway_code_ == H2ErrorCode::kNoError) {
    goaway_code_ = scanned.error() == Error::kLimitExceeded ? H2ErrorCode::kEnhanceYourCalm
                   : scanned.error() == Error::kInternal    ? H2ErrorCode::kInternalError
                                                            : H2ErrorCode::kProtocolError;
  }
  return scanned;
}

Result<std::optional<H2Request>> H2RequestScanner::scan_frames(std::string_view received) {
  if (received.size() < next_frame_) return fail(Error::kInternal, "h2 scan: received bytes shrank");
  if (next_frame_ == 0) {
    const size_t n = std::min(received.size(), kClientPreface.size());
    if (received.substr(0, n) != kClientPreface.substr(0, n)) return not_a_preface(received.front());
    if (received.size() < kClientPreface.size()) return std::optional<H2Request>();
    next_frame_ = kClientPreface.size();
  }

  const size_t limit = limits_.max_bytes_before_request;
  for (;;) {
    if (next_frame_ + kFrameHeaderBytes > limit)
      return fail(Error::kLimitExceeded, "HTTP/2: no complete request within the first " + std::to_string(limit) + " bytes");
    if (received.size() < next_frame_ + kFrameHeaderBytes) return std::optional<H2Request>();
    const FrameHeader h = read_frame_header(received.substr(next_frame_));
    if (h.length > kMaxFrameBytes)
      return protocol_error(std::string(frame_name(h.type)) + " frame of " + std::to_string(h.length) +
                            " bytes exceeds the maximum frame size " + std::to_string(kMaxFrameBytes));
    if (!settings_seen_ && (h.type != kSettings || (h.flags & kFlagAck)))
      return protocol_error("first frame is " + std::string(frame_name(h.type)) + ", not SETTINGS");
    if (open_block_stream_ != 0 && (h.type != kContinuation || h.stream_id != open_block_stream_))
      return protocol_error(std::string(frame_name(h.type)) + " frame inside the header block of stream " +
                            std::to_string(open_block_stream_) + " (only CONTINUATION may follow)");
    const size_t frame_end = next_frame_ + kFrameHeaderBytes + h.length;
    if (frame_end > limit)
      return fail(Error::kLimitExceeded, "HTTP/2: no complete request within the first " + std::to_string(limit) + " bytes");
    if (received.size() < frame_end) return std::optional<H2Request>();
    const std::string_view payload = received.substr(next_frame_ + kFrameHeaderBytes, h.length);
    next_frame_ = frame_end;

    if (h.type == kHeaders) {
      if (h.stream_id == 0 || h.stream_id % 2 == 0)
        return protocol_error("HEADERS on stream " + std::to_string(h.stream_id) + " (client streams are odd)");
      auto fragment = headers_fragment(h, payload);
      if (!fragment) return fragment.failure();
      header_block_.assign(*fragment);
      open_block_stream_ = h.stream_id;
    } else if (h.type == kContinuation) {
      if (open_block_stream_ == 0) return protocol_error("CONTINUATION without a preceding HEADERS");
      header_block_.append(payload);
    } else {
      if (Status s = check_preceding_frame(h, payload); !s) return s.failure();
      settings_seen_ = true;
      continue;
    }
    if (h.flags & kFlagEndHeaders) {
      auto decoded = decode_header_block(open_block_stream_, header_block_, limits_);
      if (!decoded) {
        // HPACK state is connection state (RFC 9113 §4.3): a block that cannot be decoded ends the connection.
        if (decoded.error() == Error::kInvalidArgument) goaway_code_ = H2ErrorCode::kCompressionError;
        return decoded.failure();
      }
      if (!*decoded) {
        malformed_stream_ = open_block_stream_;
        return decoded->failure();
      }
      return std::optional<H2Request>(std::move(**decoded));
    }
  }
}

Result<std::string> h2_refusal(uint32_t stream_id, int status, std::string_view content_type,
                               std::string_view body, std::span<const HttpHeader> extra_headers) {
  if (stream_id == 0 || stream_id % 2 == 0 || stream_id > kMaxStreamId)
    return fail(Error::kInvalidArgument, "h2 refusal: stream " + std::to_string(stream_id) + " is not a client stream");
  if (status < 200 || status > 599)
    return fail(Error::kInvalidArgument, "h2 refusal: status " + std::to_string(status) + " is not a final status");

  std::vector<HttpHeader> fields = {
      {":status", std::to_string(status)},
      {"server", "sandgate"},
      {"content-type", std::string(content_type)},
      {"content-length", std::to_string(body.size())},
      // An answer from the edge (a 401, a redirect that sets the token cookie) must never be replayed from a cache.
      {"cache-control", "no-store"},
      {"strict-transport-security", std::string(kHstsValue)},
  };
  for (const HttpHeader& h : extra_headers) {
    std::string name = h.name;
    std::transform(name.begin(), name.end(), name.begin(),
                   [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; });
    fields.push_back({std::move(name), h.value});
  }
  for (size_t i = 1; i < fields.size(); ++i)
    if (Status s = check_field_for_response(fields[i].name, fields[i].value); !s) return s.failure();

  auto block = hpack_encode(fields);
  if (!block) return block.failure();

  std::string out;
  append_frame(out, kSettings, 0, 0, {});
  append_frame(out, kSettings, kFlagAck, 0, {});
  append_header_block(out, stream_id, /*end_stream=*/body.empty(), *block);
  while (!body.empty()) {
    const std::string_view chunk = body.substr(0, kMaxFrameBytes);
    body.remove_prefix(chunk.size());
    append_frame(out, kData, body.empty() ? kFlagEndStream : 0, stream_id, chunk);
  }
  std::string goaway;
  append_u32(goaway, stream_id);
  append_u32(goaway, static_cast<uint32_t>(H2ErrorCode::kNoError));
  append_frame(out, kGoaway, 0, 0, goaway);
  return out;
}

std::string h2_goaway(H2ErrorCode code, std::string_view debug) {
  std::string out;
  append_frame(out, kSettings, 0, 0, {});
  return out + h2_goaway_frame(0, code, debug);
}

std::string h2_goaway_frame(uint32_t last_stream_id, H2ErrorCode code, std::string_view debug) {
  std::string goaway;
  append_u32(goaway, last_stream_id);
  append_u32(goaway, static_cast<uint32_t>(code));
  goaway.append(debug.substr(0, kMaxGoawayDebugBytes));
  std::string out;
  append_frame(out, kGoaway, 0, 0, goaway);
  return out;
}

}  // namespace sg
