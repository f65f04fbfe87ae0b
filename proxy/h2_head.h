// The "request head" step for connections that negotiated ALPN h2: find and decode the client's first
// request (HEADERS [+ CONTINUATION]) so the proxy can route and authenticate it, and build the few HTTP/2
// answers the proxy sends itself when it refuses a connection.
//
// The scanner never consumes or alters bytes: the proxy keeps everything it received and replays it
// unchanged to the sandbox's h2c server, so the backend decodes exactly the bytes that were inspected (HPACK
// state included: both start from an empty dynamic table). Later requests on the connection go to the same
// sandbox whatever they say, as for HTTP/1.1 keep-alive.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/http.h"

namespace sg {

struct H2ScanLimits {
  // Everything the client may send before its first request is complete (preface, SETTINGS, PING, ...,
  // the whole header block). Beyond it the scan fails with kLimitExceeded.
  size_t max_bytes_before_request = 64 * 1024;
  // Decoded header list size, counted as SETTINGS_MAX_HEADER_LIST_SIZE counts it (name + value + 32 per
  // field), so a small HPACK block that expands into megabytes is refused while it is being decoded.
  size_t max_header_list_bytes = 16 * 1024;
};

struct H2Request {
  uint32_t stream_id = 0;
  std::string method;
  std::string scheme;
  std::string authority;
  std::string path;
  // Regular fields in arrival order, names lowercase (HTTP/2 forbids anything else). Cookie crumbs are
  // joined into one "cookie" field with "; " (RFC 9113 §8.2.3), placed where the first crumb was.
  std::vector<HttpHeader> headers;
};

// Finds the first request of an HTTP/2 connection in the bytes received so far.
// Call scan() with every byte received on the connection, each time more arrive: the same bytes as before
// plus the new ones (the proxy keeps them for the replay anyway). The scanner remembers how far it got, so
// a client trickling bytes one at a time costs linear work, not quadratic. Stop calling after a request
// or an error.
//
// Returns nullopt while more bytes are needed; the request once the client preface, a SETTINGS frame, any
// PING / WINDOW_UPDATE / PRIORITY / unknown-type frames, and the first complete header block have arrived.
// Errors (the message says what was wrong):
//   kInvalidArgument: not an HTTP/2 preface (e.g. HTTP/1.1 on an h2 connection), first frame not SETTINGS,
//     a malformed or oversized frame, a frame that cannot precede the first request (DATA, RST_STREAM,
//     PUSH_PROMISE, GOAWAY), HEADERS on stream 0 or an even stream, a header block interleaved with other
//     frames, bad padding, HPACK decoding failure, a malformed request (missing or duplicate :method /
//     :scheme / :path / :authority, a Host that differs from :authority, CONNECT, uppercase or invalid field
//     names, CR/LF/NUL in values, connection-specific fields).
//   kLimitExceeded: more than max_bytes_before_request before the request is complete, or a decoded header
//     list over max_header_list_bytes.
//   kInternal: out of memory in the HPACK decoder, or `received` shorter than on the previous call.
class H2RequestScanner {
 public:
  explicit H2RequestScanner(H2ScanLimits limits = {}) : limits_(limits) {}

  Result<std::optional<H2Request>> scan(std::string_view received);

 private:
  H2ScanLimits limits_;
  size_t next_frame_ = 0;           // offset of the first frame not examined yet; 0 until the preface is seen
  bool settings_seen_ = false;      // the first frame after the preface must be SETTINGS
  uint32_t open_block_stream_ = 0;  // stream whose header block awaits CONTINUATION, 0 if none
  std::string header_block_;        // HPACK fragments of that block so far
};

// HTTP/2 error codes (RFC 9113 §7) for h2_goaway.
enum class H2ErrorCode : uint32_t {
  kNoError = 0x0,
  kProtocolError = 0x1,    // a scan failed with kInvalidArgument
  kEnhanceYourCalm = 0xb,  // a scan failed with kLimitExceeded
};

// What the proxy sends instead of forwarding, after a successful scan: the server preface (an empty SETTINGS
// frame and the ACK of the client's SETTINGS), the response on `stream_id` (HEADERS with :status,
// content-type, content-length, cache-control: no-store, server, then `extra_headers`, whose names are
// lowercased; DATA carrying `body` with END_STREAM), then GOAWAY(last_stream_id = stream_id, NO_ERROR)
// so the client knows nothing else on the connection was or will be processed.
// Pass an empty body for a HEAD request: a client rejects content on a response to HEAD.
// kInvalidArgument for a stream id or status out of range, or a field name or value that HTTP/2 cannot carry
// (CR/LF/NUL, uppercase is fine, connection-specific fields are not).
Result<std::string> h2_refusal(uint32_t stream_id, int status, std::string_view content_type,
                               std::string_view body, std::span<const HttpHeader> extra_headers);

// For a connection whose first request could not be scanned: an empty SETTINGS frame (the server preface)
// then GOAWAY(last_stream_id = 0, `code`) with `debug` (cut to 1 KiB) as debug data, which clients such as
// curl and nghttp show to the user.
std::string h2_goaway(H2ErrorCode code, std::string_view debug);

}  // namespace sg
