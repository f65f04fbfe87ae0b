// The "request head" step for connections that negotiated ALPN h2: find and decode the client's first
// request (HEADERS [+ CONTINUATION]) so the proxy can route and authenticate it, and build the few HTTP/2
// answers the proxy sends itself when it refuses a connection.
//
// The scanner never consumes or alters bytes: the proxy keeps everything it received, and once the sandbox
// is open, every byte from the preface on goes through H2ClientFilter (h2_filter.h), which checks every
// request, the first one again included, and re-encodes what it forwards.
//
// The `h2` namespace at the end holds the wire-level building blocks (frame layout, request validation, HPACK
// block decoding) that the scanner shares with the connection-long filter in h2_filter.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/http.h"

// nghttp2's HPACK coder types (nghttp2/nghttp2.h), named here without pulling the whole C API into every user.
struct nghttp2_hd_inflater;
struct nghttp2_hd_deflater;

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
  // :protocol of an extended CONNECT (RFC 8441, e.g. "websocket"), empty for every other request. Such a
  // CONNECT carries :scheme and :path like any request and is routed and authenticated like one; whether the
  // sandbox offers it (SETTINGS_ENABLE_CONNECT_PROTOCOL) is the sandbox's to judge.
  std::string protocol;
  // Regular fields in arrival order, names lowercase (HTTP/2 forbids anything else). Cookie crumbs are
  // joined into one "cookie" field with "; " (RFC 9113 §8.2.3), placed where the first crumb was.
  std::vector<HttpHeader> headers;
};

// HTTP/2 error codes (RFC 9113 §7) for h2_goaway.
enum class H2ErrorCode : uint32_t {
  kNoError = 0x0,
  kProtocolError = 0x1,     // a scan failed with kInvalidArgument
  kInternalError = 0x2,     // a scan failed with kInternal
  kCompressionError = 0x9,  // the first header block is not valid HPACK (RFC 9113 §4.3)
  kEnhanceYourCalm = 0xb,   // a scan failed with kLimitExceeded
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
//     frames, bad padding, HPACK decoding failure; or a malformed request (missing or duplicate :method /
//     :scheme / :path / :authority, a Host that differs from :authority, a CONNECT without :protocol,
//     :protocol without CONNECT, uppercase or invalid field names, CR/LF/NUL or whitespace at either end in
//     values, connection-specific fields). Only the malformed request is an error of its stream alone
//     (RFC 9113 §8.1.1): malformed_stream() tells the two apart.
//   kLimitExceeded: more than max_bytes_before_request before the request is complete, or a decoded header
//     list over max_header_list_bytes.
//   kInternal: out of memory in the HPACK decoder, or `received` shorter than on the previous call.
class H2RequestScanner {
 public:
  explicit H2RequestScanner(H2ScanLimits limits = {}) : limits_(limits) {}

  Result<std::optional<H2Request>> scan(std::string_view received);

  // After scan() failed: the stream whose request was malformed (its header block decoded fine, the fields
  // break RFC 9113 §8), which is answered with h2_refusal(stream, 400, ...) while the connection is ended
  // gracefully; 0 when the connection itself is broken and gets h2_goaway(goaway_code(), ...).
  uint32_t malformed_stream() const { return malformed_stream_; }
  // After scan() failed with malformed_stream() == 0: the GOAWAY error code the failure calls for
  // (COMPRESSION_ERROR for HPACK, ENHANCE_YOUR_CALM for a limit, INTERNAL_ERROR for kInternal,
  // PROTOCOL_ERROR otherwise).
  H2ErrorCode goaway_code() const { return goaway_code_; }

 private:
  Result<std::optional<H2Request>> scan_frames(std::string_view received);

  H2ScanLimits limits_;
  uint32_t malformed_stream_ = 0;
  H2ErrorCode goaway_code_ = H2ErrorCode::kNoError;  // set with the failure
  size_t next_frame_ = 0;           // offset of the first frame not examined yet; 0 until the preface is seen
  bool settings_seen_ = false;      // the first frame after the preface must be SETTINGS
  uint32_t open_block_stream_ = 0;  // stream whose header block awaits CONTINUATION, 0 if none
  std::string header_block_;        // HPACK fragments of that block so far
};

// What the proxy sends instead of forwarding, after a successful scan or one that named a malformed_stream()
// (then with 400): the server preface (an empty SETTINGS frame and the ACK of the client's SETTINGS), the
// response on `stream_id` (HEADERS with :status, content-type, content-length, cache-control: no-store,
// server, then `extra_headers`, whose names are lowercased; DATA carrying `body` with END_STREAM), then
// GOAWAY(last_stream_id = stream_id, NO_ERROR) so the client knows nothing else on the connection was or
// will be processed.
// Pass an empty body for a HEAD request: a client rejects content on a response to HEAD.
// kInvalidArgument for a stream id or status out of range, or a field name or value that HTTP/2 cannot carry
// (CR/LF/NUL, uppercase is fine, connection-specific fields are not).
Result<std::string> h2_refusal(uint32_t stream_id, int status, std::string_view content_type,
                               std::string_view body, std::span<const HttpHeader> extra_headers);

// For a connection whose first request could not be scanned: an empty SETTINGS frame (the server preface)
// then GOAWAY(last_stream_id = 0, `code`) with `debug` (cut to 1 KiB) as debug data, which clients such as
// curl and nghttp show to the user.
std::string h2_goaway(H2ErrorCode code, std::string_view debug);
// GOAWAY alone, for a connection whose server preface the peer already has: `last_stream_id` is the highest
// client stream the server may have acted on (the client may retry the ones above it).
std::string h2_goaway_frame(uint32_t last_stream_id, H2ErrorCode code, std::string_view debug);

// Building blocks shared by H2RequestScanner and H2ClientFilter / H2ServerFrames (h2_filter.h). Not meant for
// other callers: they encode RFC 9113 / RFC 7541 details, not proxy policy.
namespace h2 {

inline constexpr std::string_view kClientPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
inline constexpr size_t kFrameHeaderBytes = 9;
// SETTINGS_MAX_FRAME_SIZE's initial value, which every peer accepts whatever it announced later.
inline constexpr size_t kDefaultMaxFrameBytes = 16384;
// The 24-bit length field cannot say more (RFC 9113 §4.1).
inline constexpr size_t kMaxFrameLength = (size_t{1} << 24) - 1;
// RFC 9113 §6.5.2 / RFC 7541 §4.1: every field costs its name, its value and 32 bytes of overhead.
inline constexpr size_t kFieldOverheadBytes = 32;
// HPACK dynamic table size both ends start with (SETTINGS_HEADER_TABLE_SIZE's initial value).
inline constexpr size_t kDefaultHpackTableBytes = 4096;
inline constexpr uint32_t kMaxStreamId = 0x7fffffff;
inline constexpr size_t kSettingsEntryBytes = 6;
inline constexpr uint16_t kSettingsHeaderTableSize = 0x1;
inline constexpr uint16_t kSettingsEnableConnectProtocol = 0x8;  // RFC 8441

enum FrameType : uint8_t {
  kData = 0x0,
  kHeaders = 0x1,
  kPriority = 0x2,
  kRstStream = 0x3,
  kSettings = 0x4,
  kPushPromise = 0x5,
  kPing = 0x6,
  kGoaway = 0x7,
  kWindowUpdate = 0x8,
  kContinuation = 0x9,
};

inline constexpr uint8_t kFlagEndStream = 0x1;
inline constexpr uint8_t kFlagAck = 0x1;
inline constexpr uint8_t kFlagEndHeaders = 0x4;
inline constexpr uint8_t kFlagPadded = 0x8;
inline constexpr uint8_t kFlagPriority = 0x20;

struct FrameHeader {
  uint32_t length = 0;
  uint8_t type = 0;
  uint8_t flags = 0;
  uint32_t stream_id = 0;  // reserved bit cleared
};

// `s` holds at least kFrameHeaderBytes bytes.
FrameHeader read_frame_header(std::string_view s);
void append_u32(std::string& out, uint32_t v);
void append_frame(std::string& out, uint8_t type, uint8_t flags, uint32_t stream_id, std::string_view payload);
// HEADERS then as many CONTINUATION frames as `block` needs, each at most kDefaultMaxFrameBytes, END_HEADERS on
// the last, END_STREAM (on the HEADERS) if asked. An empty block still makes one HEADERS frame.
void append_header_block(std::string& out, uint32_t stream_id, bool end_stream, std::string_view block);
std::string_view frame_name(uint8_t type);

// kInvalidArgument with an "HTTP/2: " prefix.
Failure protocol_error(std::string message);
// The bytes received where the client preface was expected differ from it; `first_byte` is the first one.
Failure not_a_preface(char first_byte);

// The header block fragment of a complete HEADERS frame payload: without the pad length, priority fields and
// padding.
Result<std::string_view> headers_fragment(const FrameHeader& h, std::string_view payload);

// RFC 9113 §8.2.1 / §8.2.2 checks on one field of a request (or its trailers).
Status check_field_name(std::string_view name);
Status check_field_value(std::string_view name, std::string_view value);
bool is_connection_specific(std::string_view lowercase_name);

struct InflaterDeleter {
  void operator()(nghttp2_hd_inflater* p) const;
};
struct DeflaterDeleter {
  void operator()(nghttp2_hd_deflater* p) const;
};
using InflaterPtr = std::unique_ptr<nghttp2_hd_inflater, InflaterDeleter>;
using DeflaterPtr = std::unique_ptr<nghttp2_hd_deflater, DeflaterDeleter>;

// Decodes one complete header block with `inflater`, whose dynamic table carries over from block to block
// (call it for every block of the connection, in order). Calls on_field for each field as soon as it is
// decoded and stops with kLimitExceeded once the list exceeds max_list_bytes (counted as
// SETTINGS_MAX_HEADER_LIST_SIZE counts), so a small block that expands into megabytes is never built.
// kInvalidArgument on an HPACK error (the inflater is then unusable: the connection must end), kInternal if
// out of memory, or on_field's own failure.
using FieldSink = std::function<Status(std::string_view name, std::string_view value)>;
Status inflate_header_block(nghttp2_hd_inflater* inflater, std::string_view block, size_t max_list_bytes,
                            const FieldSink& on_field);

// Decodes one request header block with `inflater` (as inflate_header_block) and checks it (RequestBuilder).
// A malformed request is an error of its stream only (RFC 9113 §8.1.1): the block is still decoded to its
// end, so the inflater keeps following the client's encoder, and the inner Result carries why (kInvalidArgument).
// The outer Result fails only for the connection: HPACK error (kInvalidArgument), limit, out of memory.
Result<Result<H2Request>> decode_request(nghttp2_hd_inflater* inflater, uint32_t stream_id, std::string_view block,
                                         size_t max_list_bytes);

// Collects the fields of one request header block and checks them against RFC 9113 §8.2 and §8.3.1 (the
// rules listed at H2RequestScanner). add() each field in order, then finish().
class RequestBuilder {
 public:
  explicit RequestBuilder(uint32_t stream_id) { request_.stream_id = stream_id; }
  Status add(std::string_view name, std::string_view value);
  Result<H2Request> finish() &&;

 private:
  Status add_pseudo(std::string_view name, std::string_view value);

  H2Request request_;
  bool method_seen_ = false, scheme_seen_ = false, authority_seen_ = false, path_seen_ = false;
  bool protocol_seen_ = false;
  bool regular_seen_ = false;
  std::optional<size_t> cookie_index_;
  std::vector<std::string> host_values_;
};

}  // namespace h2
}  // namespace sg
