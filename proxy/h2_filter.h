// Per-request routing and credential stripping for HTTP/2 connections.
//
// Browsers coalesce HTTP/2 connections across every host a certificate covers, so one connection from the
// client can carry requests for several sandboxes, each with that sandbox's cookie. Replaying the client's
// bytes unchanged (what the first-request scan in h2_head.h allows) would forward all of them to the sandbox
// the first request chose, credentials included. Instead:
//
//   client -> sandbox: H2ClientFilter decodes EVERY header block with one HPACK inflater that lives as long as
//     the connection, hands each request to the connection (which edits its fields or refuses it), and
//     re-encodes every forwarded block with its own HPACK encoder. That encoder never uses a dynamic table
//     (deflate table size 0), so removing fields is possible and the sandbox's decoder follows our encoder, not
//     the client's; nothing depends on the sandbox's SETTINGS_HEADER_TABLE_SIZE.
//   sandbox -> client: H2ServerFrames passes the sandbox's bytes through unchanged and inserts the proxy's own
//     answers to refused streams between the sandbox's frames.
//
// Refused streams never reach the sandbox; the proxy answers them itself and drops their later frames.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "proxy/h2_head.h"

namespace sg {

struct H2FilterLimits {
  // Decoded size of one header block, counted as SETTINGS_MAX_HEADER_LIST_SIZE counts it (name + value + 32
  // per field); enforced while decoding, so a small block that expands into megabytes is stopped early.
  size_t max_header_list_bytes = 16 * 1024;
  // Encoded HPACK bytes of one header block: the payloads (padding included) of its HEADERS and CONTINUATION
  // frames together. Checked from each frame header, before the payload is buffered.
  size_t max_header_block_bytes = 64 * 1024;
  // The largest sandbox SETTINGS_HEADER_TABLE_SIZE the inflater follows (the memory one connection's client
  // HPACK table may take). The protocol's initial 4096 is always accepted.
  size_t max_hpack_table_bytes = 64 * 1024;
  // Refused stream ids remembered (oldest forgotten first) to drop their later frames. A frame on a forgotten
  // one is forwarded, and the sandbox treats it as a frame on a stream it never saw.
  size_t max_refused_streams = 256;
};

struct H2Verdict {
  // 0: forward the request with the H2Request fields as the callback left them. Otherwise a final status
  // (200..599, e.g. 421) the proxy answers on that stream itself; nothing of the stream reaches the sandbox.
  int refuse_status = 0;
};

// Client -> sandbox. Fed every byte the client sends, from the very first (the 24-byte client preface) on.
//
// What goes to the sandbox: the preface and every frame unchanged, except
//   - HEADERS (+ CONTINUATION): decoded, then re-encoded as HEADERS (+ CONTINUATION) with the same END_STREAM
//     (a request's pseudo-headers :method, :scheme, :authority, :path, and :protocol for an extended CONNECT),
//     without padding or priority fields (RFC 9113 deprecates the latter), in frames of at most 16384 bytes
//     (within any peer's SETTINGS_MAX_FRAME_SIZE); regular fields are sent "never indexed".
//   - frames of a refused stream: dropped (DATA, HEADERS, CONTINUATION, WINDOW_UPDATE, RST_STREAM, PRIORITY).
// What goes to the client (through H2ServerFrames::inject): for a refused stream a HEADERS with :status,
// content-length: 0 and server: sandgate, END_STREAM (no DATA: a body would take flow-control window the
// sandbox does not know about), then RST_STREAM(NO_ERROR) if the client had not finished its request; for
// each dropped DATA frame a connection WINDOW_UPDATE giving its window back.
class H2ClientFilter {
 public:
  // Called once per request (a HEADERS opening a client stream), decoded and validated as H2RequestScanner
  // validates the first request. The callback may edit any field of the request (remove a credential, rewrite
  // the cookie, the path) and says whether to forward it. It is not called for trailers.
  using OnRequest = std::function<H2Verdict(H2Request&)>;

  H2ClientFilter(H2FilterLimits limits, OnRequest on_request);
  ~H2ClientFilter();
  H2ClientFilter(const H2ClientFilter&) = delete;
  H2ClientFilter& operator=(const H2ClientFilter&) = delete;

  // A request that breaks RFC 9113 §8 (the checks listed at H2RequestScanner) is refused with 400 on its
  // stream, the connection going on; this is told which stream and why (for the access log).
  void set_on_malformed(std::function<void(uint32_t stream_id, std::string_view why)> fn) { on_malformed_ = std::move(fn); }

  // Consumes all of `in`, which may end anywhere (mid-frame, mid-preface). Appends what goes to the sandbox to
  // `to_sandbox` and the proxy's own frames for the client to `to_client`.
  // Errors (the message says what was wrong), after which every call fails the same way:
  //   kInvalidArgument: a protocol error (not the preface, first frame not SETTINGS, PUSH_PROMISE, HEADERS on
  //     stream 0 or an even stream, a frame inside a header block, CONTINUATION without HEADERS, bad padding,
  //     HPACK decoding failure, trailers with pseudo-headers or without END_STREAM). A malformed request is
  //     not one of them: its stream gets 400 (set_on_malformed).
  //   kLimitExceeded: a header block or a decoded header list over the limits.
  //   kInternal: out of memory, or the callback refused with a status outside 200..599.
  // The caller then answers with h2_goaway(goaway_code(), ...) and closes.
  Status feed(std::string_view in, std::string& to_sandbox, std::string& to_client);

  // The sandbox announced SETTINGS_HEADER_TABLE_SIZE (H2ServerFrames::feed reports it): the client's HPACK
  // encoder may now use up to it. Capped at max_hpack_table_bytes: a client using more fails decoding. Only
  // raises the limit, never lowers it: blocks the client sent before it saw a smaller value are still encoded
  // for the larger one, and since the sandbox never decodes the client's HPACK, enforcing the smaller value
  // would only break such clients.
  void set_sandbox_header_table_size(uint32_t bytes);
  // The sandbox's first SETTINGS arrived, enabling extended CONNECT or not (H2ServerFrames::extended_connect).
  // Once it is known not to be enabled, an extended CONNECT (:protocol) is malformed (RFC 8441 §3: a client may
  // send one only after SETTINGS_ENABLE_CONNECT_PROTOCOL = 1) and its stream is answered 400 by the edge, as any
  // malformed request. Before that (the first request, which the sandbox is connected for) it is forwarded,
  // and the sandbox's server judges it.
  void set_sandbox_extended_connect(bool enabled) { sandbox_extended_connect_ = enabled; }

  // After feed() failed: the GOAWAY error code for it (COMPRESSION_ERROR for an HPACK failure, which leaves
  // the connection's decoder unusable; ENHANCE_YOUR_CALM past a limit; PROTOCOL_ERROR otherwise).
  H2ErrorCode goaway_code() const { return goaway_code_; }
  // The highest stream whose request went to the sandbox (GOAWAY's last stream id), 0 before any.
  uint32_t last_forwarded_stream() const { return last_forwarded_stream_; }

 private:
  enum class Payload : uint8_t { kForward, kDrop, kCollect };
  enum class BlockKind : uint8_t { kRequest, kTrailers, kRefusedTrailers };

  Status process(std::string_view in, std::string& to_sandbox, std::string& to_client);
  Status start_frame(std::string& to_sandbox, std::string& to_client);
  Status end_frame(std::string& to_sandbox, std::string& to_client);
  Status finish_block(std::string& to_sandbox, std::string& to_client);
  // Encodes `request`'s pseudo-headers (if any) and `fields`, appends HEADERS (+ CONTINUATION) to to_sandbox.
  Status forward_block(uint32_t stream_id, const H2Request* request, const std::vector<HttpHeader>& fields,
                       bool end_stream, std::string& to_sandbox);
  Status refuse(uint32_t stream_id, int status, bool end_stream, std::string& to_client);
  bool is_refused(uint32_t stream_id) const;

  H2FilterLimits limits_;
  OnRequest on_request_;
  std::function<void(uint32_t, std::string_view)> on_malformed_;
  h2::InflaterPtr inflater_;
  h2::DeflaterPtr deflater_;
  std::optional<Failure> failed_;   // sticky: the first error, returned by every later feed
  H2ErrorCode goaway_code_ = H2ErrorCode::kNoError;  // set with failed_
  uint32_t last_forwarded_stream_ = 0;
  size_t hpack_table_limit_;        // what the inflater accepts as the client's table size
  std::optional<bool> sandbox_extended_connect_;  // unknown until the sandbox's first SETTINGS

  size_t preface_matched_ = 0;
  bool frame_seen_ = false;                          // the first frame must be SETTINGS
  std::array<char, h2::kFrameHeaderBytes> header_{};  // the current frame's header, possibly partial
  size_t header_len_ = 0;
  h2::FrameHeader frame_;
  size_t payload_left_ = 0;
  Payload payload_ = Payload::kForward;

  // The header block being collected (HEADERS without END_HEADERS so far); block_open_ false between blocks.
  bool block_open_ = false;
  uint32_t block_stream_ = 0;
  BlockKind block_kind_ = BlockKind::kRequest;
  bool block_end_stream_ = false;
  size_t block_frame_bytes_ = 0;  // payload bytes of the block's frames, for max_header_block_bytes
  std::string block_;             // HPACK fragments (while a HEADERS frame is read: its whole payload)

  uint32_t last_client_stream_ = 0;  // highest stream a HEADERS opened, forwarded or refused
  // Ascending (stream ids only grow), at most max_refused_streams. A vector: libstdc++'s deque allocates
  // 576 bytes even empty, for every h2 connection.
  std::vector<uint32_t> refused_;
};

// Sandbox -> client. Passes the sandbox's bytes through unchanged, tracking frame boundaries, so the proxy's
// own frames are inserted only between frames: never before the sandbox's first frame (its SETTINGS, the
// server preface), never inside a frame, never inside a header block (HEADERS / PUSH_PROMISE until the
// CONTINUATION with END_HEADERS).
class H2ServerFrames {
 public:
  // Bounds what waits for a boundary (a sandbox that stalls mid-block while the client keeps opening refused
  // streams must not grow it without end).
  explicit H2ServerFrames(size_t max_queued_bytes = 64 * 1024) : max_queued_bytes_(max_queued_bytes) {}

  // Queues frames the proxy sends the client (H2ClientFilter::feed's to_client); they go out at the first
  // allowed boundary, in order. kLimitExceeded if the queue would exceed max_queued_bytes (nothing is queued).
  Status inject(std::string_view frames);

  // Consumes all of `in` (split anywhere) and appends to `out` the same bytes with queued frames inserted at
  // allowed boundaries. Call with an empty `in` to flush the queue when the sandbox is idle at a boundary.
  // Returns the largest SETTINGS_HEADER_TABLE_SIZE announced by non-ACK SETTINGS frames completed during this
  // call (for H2ClientFilter::set_sandbox_header_table_size), nullopt if none.
  // kInvalidArgument (sticky) on a malformed frame sequence: first frame not SETTINGS, SETTINGS on a stream or
  // not a multiple of 6 bytes or an ACK with a payload, a frame other than CONTINUATION inside a header block,
  // CONTINUATION outside one.
  Result<std::optional<uint32_t>> feed(std::string_view in, std::string& out);

  bool has_queued() const { return !queue_.empty(); }
  // Whether the sandbox enabled extended CONNECT (SETTINGS_ENABLE_CONNECT_PROTOCOL = 1 in a complete SETTINGS
  // frame; RFC 8441: it cannot be turned off again); unknown until its first SETTINGS frame is complete.
  std::optional<bool> extended_connect() const { return extended_connect_; }

 private:
  Status start_frame();
  void end_frame(std::optional<uint32_t>& announced, std::string& out);
  void flush(std::string& out);

  size_t max_queued_bytes_;
  std::string queue_;
  std::optional<Failure> failed_;

  std::array<char, h2::kFrameHeaderBytes> header_{};
  size_t header_len_ = 0;
  h2::FrameHeader frame_;
  size_t payload_left_ = 0;
  bool frame_seen_ = false;        // a frame has started
  bool first_frame_done_ = false;  // the server preface has passed
  bool block_open_ = false;        // inside HEADERS / PUSH_PROMISE ... CONTINUATION
  uint32_t block_stream_ = 0;

  // The non-ACK SETTINGS frame being read: its entries parsed as they stream by.
  bool in_settings_ = false;
  std::array<char, h2::kSettingsEntryBytes> entry_{};
  size_t entry_len_ = 0;
  std::optional<uint32_t> frame_table_size_;
  std::optional<uint32_t> frame_connect_protocol_;
  std::optional<bool> extended_connect_;
};

}  // namespace sg
