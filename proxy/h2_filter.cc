#include "proxy/h2_filter.h"

#include <nghttp2/nghttp2.h>

#include <algorithm>
#include <cstring>
#include <utility>

namespace sg {

using namespace h2;  // NOLINT(google-build-using-namespace): the wire vocabulary of this file

namespace {

// Buffers above this are given back once a header block or the injection queue is done with them, so an idle
// connection does not keep a 64 KiB block buffer.
constexpr size_t kKeptBufferBytes = 4096;

void release(std::string& buffer) {
  if (buffer.capacity() > kKeptBufferBytes) std::string().swap(buffer);
  else buffer.clear();
}

// RFC 7541 §5.1 integer with an N-bit prefix; `first` carries the representation's pattern bits.
void hpack_integer(std::string& out, uint8_t first, int prefix_bits, size_t value) {
  const size_t max_prefix = (size_t{1} << prefix_bits) - 1;
  if (value < max_prefix) {
    out.push_back(static_cast<char>(first | value));
    return;
  }
  out.push_back(static_cast<char>(first | max_prefix));
  value -= max_prefix;
  while (value >= 0x80) {
    out.push_back(static_cast<char>(0x80 | (value & 0x7f)));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

// RFC 7541 §6.2.2 "literal header field without indexing" with a static-table name and a raw (not Huffman)
// value: the decoder adds nothing to its dynamic table.
void literal_without_indexing(std::string& out, size_t static_name_index, std::string_view value) {
  hpack_integer(out, 0x00, 4, static_name_index);
  hpack_integer(out, 0x00, 7, value.size());
  out.append(value);
}

// The header block of the proxy's answer to a refused stream. The client's HPACK decoder belongs to the
// sandbox's encoder (its dynamic table follows what the sandbox sent), so this block uses only representations
// that leave that table alone: static-table references and literals without indexing. No dynamic table size
// update either (which nghttp2's own encoder would emit first), for the same reason.
std::string refusal_block(int status) {
  // RFC 7541 Appendix A static table.
  constexpr size_t kStatusName = 8, kContentLengthName = 28, kServerName = 54;
  constexpr std::pair<int, uint8_t> kIndexedStatus[] = {{200, 8},  {204, 9},  {206, 10}, {304, 11},
                                                        {400, 12}, {404, 13}, {500, 14}};
  std::string block;
  const auto* indexed = std::find_if(std::begin(kIndexedStatus), std::end(kIndexedStatus),
                                     [&](const auto& e) { return e.first == status; });
  if (indexed != std::end(kIndexedStatus)) block.push_back(static_cast<char>(0x80 | indexed->second));
  else literal_without_indexing(block, kStatusName, std::to_string(status));
  literal_without_indexing(block, kContentLengthName, "0");
  literal_without_indexing(block, kServerName, "sandgate");
  return block;
}

nghttp2_nv make_nv(std::string_view name, std::string_view value, uint8_t flags) {
  return nghttp2_nv{reinterpret_cast<uint8_t*>(const_cast<char*>(name.data())),
                    reinterpret_cast<uint8_t*>(const_cast<char*>(value.data())), name.size(), value.size(), flags};
}

// Trailers carry no pseudo-headers (RFC 9113 §8.1) and obey the same field rules as the request.
Status check_trailer_field(std::string_view name, std::string_view value) {
  if (!name.empty() && name.front() == ':')
    return protocol_error("pseudo-header " + std::string(name) + " in trailers");
  if (Status s = check_field_name(name); !s) return s;
  if (Status s = check_field_value(name, value); !s) return s;
  if (is_connection_specific(name))
    return protocol_error("connection-specific field '" + std::string(name) + "' is not allowed");
  return {};
}

Failure block_too_large(uint32_t stream_id, size_t limit) {
  return fail(Error::kLimitExceeded, "HTTP/2: header block of stream " + std::to_string(stream_id) + " exceeds " +
                                         std::to_string(limit) + " bytes");
}

}  // namespace

// --- H2ClientFilter ---

H2ClientFilter::H2ClientFilter(H2FilterLimits limits, OnRequest on_request)
    : limits_(limits), on_request_(std::move(on_request)), hpack_table_limit_(kDefaultHpackTableBytes) {
  nghttp2_hd_inflater* inflater = nullptr;
  nghttp2_hd_deflater* deflater = nullptr;
  if (nghttp2_hd_inflate_new(&inflater) != 0) {
    failed_ = fail(Error::kInternal, "HPACK decoder: out of memory");
    return;
  }
  inflater_.reset(inflater);
  // Table size 0: the encoder never inserts into the sandbox's dynamic table, so our output does not depend
  // on the sandbox's SETTINGS_HEADER_TABLE_SIZE (its first block says "size 0", valid under any setting).
  if (nghttp2_hd_deflate_new(&deflater, 0) != 0) {
    failed_ = fail(Error::kInternal, "HPACK encoder: out of memory");
    return;
  }
  deflater_.reset(deflater);
}

H2ClientFilter::~H2ClientFilter() = default;

void H2ClientFilter::set_sandbox_header_table_size(uint32_t bytes) {
  const size_t wanted = std::min<size_t>(bytes, limits_.max_hpack_table_bytes);
  if (failed_ || wanted <= hpack_table_limit_) return;  // only ever raised: see h2_filter.h
  // Blocks are decoded whole within feed(), so the inflater is always between blocks here, where nghttp2
  // allows the change.
  if (int rv = nghttp2_hd_inflate_change_table_size(inflater_.get(), wanted); rv != 0) {
    failed_ = fail(Error::kInternal, "HPACK decoder: cannot change the table size: " + std::string(nghttp2_strerror(rv)));
    return;
  }
  hpack_table_limit_ = wanted;
}

Status H2ClientFilter::feed(std::string_view in, std::string& to_sandbox, std::string& to_client) {
  if (failed_) return *failed_;
  Status s = process(in, to_sandbox, to_client);
  if (!s) {
    failed_ = s.failure();
    if (goaway_code_ == H2ErrorCode::kNoError)
      goaway_code_ = s.error() == Error::kLimitExceeded ? H2ErrorCode::kEnhanceYourCalm
                     : s.error() == Error::kInternal    ? H2ErrorCode::kInternalError
                                                        : H2ErrorCode::kProtocolError;
  }
  return s;
}

Status H2ClientFilter::process(std::string_view in, std::string& to_sandbox, std::string& to_client) {
  while (!in.empty()) {
    if (preface_matched_ < kClientPreface.size()) {
      const size_t n = std::min(in.size(), kClientPreface.size() - preface_matched_);
      if (in.substr(0, n) != kClientPreface.substr(preface_matched_, n))
        return not_a_preface(preface_matched_ == 0 ? in.front() : kClientPreface.front());
      preface_matched_ += n;
      in.remove_prefix(n);
      // Nothing reaches the sandbox before the whole preface is known to be one.
      if (preface_matched_ == kClientPreface.size()) to_sandbox.append(kClientPreface);
      continue;
    }
    if (header_len_ < kFrameHeaderBytes) {
      const size_t n = std::min(in.size(), kFrameHeaderBytes - header_len_);
      std::memcpy(header_.data() + header_len_, in.data(), n);
      header_len_ += n;
      in.remove_prefix(n);
      if (header_len_ < kFrameHeaderBytes) break;
      frame_ = read_frame_header(std::string_view(header_.data(), header_.size()));
      payload_left_ = frame_.length;
      if (Status s = start_frame(to_sandbox, to_client); !s) return s;
      if (payload_left_ == 0)
        if (Status s = end_frame(to_sandbox, to_client); !s) return s;
      continue;
    }
    // DATA and the other pass-through frames stream by; only header blocks are buffered (bounded above).
    const std::string_view chunk = in.substr(0, std::min(in.size(), payload_left_));
    if (payload_ == Payload::kForward) to_sandbox.append(chunk);
    else if (payload_ == Payload::kCollect) block_.append(chunk);
    payload_left_ -= chunk.size();
    in.remove_prefix(chunk.size());
    if (payload_left_ == 0)
      if (Status s = end_frame(to_sandbox, to_client); !s) return s;
  }
  return {};
}

Status H2ClientFilter::start_frame(std::string& to_sandbox, std::string& to_client) {
  const FrameHeader& h = frame_;
  if (!frame_seen_) {
    if (h.type != kSettings || (h.flags & kFlagAck))
      return protocol_error("first frame is " + std::string(frame_name(h.type)) + ", not SETTINGS");
    frame_seen_ = true;
  }
  if (block_open_ && (h.type != kContinuation || h.stream_id != block_stream_))
    return protocol_error(std::string(frame_name(h.type)) + " frame inside the header block of stream " +
                          std::to_string(block_stream_) + " (only CONTINUATION may follow)");
  switch (h.type) {
    case kHeaders: {
      if (h.stream_id == 0 || h.stream_id % 2 == 0)
        return protocol_error("HEADERS on stream " + std::to_string(h.stream_id) + " (client streams are odd)");
      if (h.length > limits_.max_header_block_bytes) return block_too_large(h.stream_id, limits_.max_header_block_bytes);
      const bool end_stream = h.flags & kFlagEndStream;
      if (h.stream_id > last_client_stream_) {
        block_kind_ = BlockKind::kRequest;
        last_client_stream_ = h.stream_id;
      } else if (is_refused(h.stream_id)) {
        block_kind_ = BlockKind::kRefusedTrailers;
      } else {
        // A stream id at or below the last one opened: the trailers of a forwarded request, nothing else.
        if (!end_stream)
          return protocol_error("HEADERS without END_STREAM on stream " + std::to_string(h.stream_id) +
                                ", which already has its request (only trailers may follow)");
        block_kind_ = BlockKind::kTrailers;
      }
      block_open_ = true;
      block_stream_ = h.stream_id;
      block_end_stream_ = end_stream;
      block_frame_bytes_ = h.length;
      block_.clear();
      payload_ = Payload::kCollect;
      return {};
    }
    case kContinuation:
      if (!block_open_) return protocol_error("CONTINUATION without a preceding HEADERS");
      block_frame_bytes_ += h.length;
      if (block_frame_bytes_ > limits_.max_header_block_bytes)
        return block_too_large(h.stream_id, limits_.max_header_block_bytes);
      payload_ = Payload::kCollect;
      return {};
    case kPushPromise:
      return protocol_error("PUSH_PROMISE from a client (only servers push)");
    case kData:
      if (is_refused(h.stream_id)) {
        payload_ = Payload::kDrop;
        // The client took the whole payload (padding included) from its connection window; the sandbox never
        // sees these bytes, so it will never give them back: the proxy does. A zero increment would be a
        // protocol error.
        if (h.length > 0) {
          std::string increment;
          append_u32(increment, h.length);
          append_frame(to_client, kWindowUpdate, 0, 0, increment);
        }
        return {};
      }
      break;
    case kWindowUpdate:
    case kRstStream:
    case kPriority:
      // The sandbox never saw a refused stream: to it these would be frames on an idle stream (a connection
      // error for RST_STREAM and WINDOW_UPDATE).
      if (is_refused(h.stream_id)) {
        payload_ = Payload::kDrop;
        return {};
      }
      break;
    default:
      break;  // SETTINGS, PING, GOAWAY and extension frames are the sandbox's business
  }
  payload_ = Payload::kForward;
  to_sandbox.append(header_.data(), header_.size());
  return {};
}

Status H2ClientFilter::end_frame(std::string& to_sandbox, std::string& to_client) {
  header_len_ = 0;
  if (frame_.type != kHeaders && frame_.type != kContinuation) return {};
  if (frame_.type == kHeaders) {
    auto fragment = headers_fragment(frame_, block_);
    if (!fragment) return fragment.failure();
    // Keep only the fragment: block_ held the whole payload (pad length, priority fields, padding).
    const size_t offset = static_cast<size_t>(fragment->data() - block_.data());
    const size_t length = fragment->size();
    block_.erase(0, offset);
    block_.resize(length);
  }
  if (!(frame_.flags & kFlagEndHeaders)) return {};
  Status s = finish_block(to_sandbox, to_client);
  release(block_);
  return s;
}

Status H2ClientFilter::finish_block(std::string& to_sandbox, std::string& to_client) {
  block_open_ = false;
  const uint32_t stream = block_stream_;
  switch (block_kind_) {
    case BlockKind::kRequest: {
      // A malformed request is an error of its stream only (RFC 9113 §8.1.1): the stream is answered 400.
      auto decoded = decode_request(inflater_.get(), stream, block_, limits_.max_header_list_bytes);
      if (!decoded) {
        if (decoded.error() == Error::kInvalidArgument) goaway_code_ = H2ErrorCode::kCompressionError;
        return decoded.failure();
      }
      Result<H2Request>& request = *decoded;
      if (request && !request->protocol.empty() && sandbox_extended_connect_ == false)
        request = fail(Error::kInvalidArgument,
                       "HTTP/2: extended CONNECT (:protocol " + request->protocol +
                           ") before the sandbox enabled it (SETTINGS_ENABLE_CONNECT_PROTOCOL, RFC 8441)");
      if (!request) {
        if (on_malformed_) on_malformed_(stream, request.message());
        return refuse(stream, 400, block_end_stream_, to_client);
      }
      const H2Verdict verdict = on_request_(*request);
      if (verdict.refuse_status != 0) return refuse(stream, verdict.refuse_status, block_end_stream_, to_client);
      last_forwarded_stream_ = std::max(last_forwarded_stream_, stream);
      return forward_block(stream, &*request, request->headers, block_end_stream_, to_sandbox);
    }
    case BlockKind::kTrailers: {
      std::vector<HttpHeader> fields;
      bool bad_field = false;
      Status decoded = inflate_header_block(inflater_.get(), block_, limits_.max_header_list_bytes,
                                            [&](std::string_view name, std::string_view value) {
                                              if (Status s = check_trailer_field(name, value); !s) {
                                                bad_field = true;
                                                return s;
                                              }
                                              fields.push_back({std::string(name), std::string(value)});
                                              return Status();
                                            });
      if (!decoded) {
        if (decoded.error() == Error::kInvalidArgument && !bad_field) goaway_code_ = H2ErrorCode::kCompressionError;
        return decoded;
      }
      return forward_block(stream, nullptr, fields, /*end_stream=*/true, to_sandbox);
    }
    case BlockKind::kRefusedTrailers: {
      // Decoded only so the inflater's dynamic table keeps following the client's encoder; then dropped.
      Status decoded = inflate_header_block(inflater_.get(), block_, limits_.max_header_list_bytes,
                                            [](std::string_view, std::string_view) { return Status(); });
      if (!decoded && decoded.error() == Error::kInvalidArgument) goaway_code_ = H2ErrorCode::kCompressionError;
      return decoded;
    }
  }
  return fail(Error::kInternal, "h2 filter: unknown header block kind");
}

Status H2ClientFilter::forward_block(uint32_t stream_id, const H2Request* request,
                                     const std::vector<HttpHeader>& fields, bool end_stream,
                                     std::string& to_sandbox) {
  std::vector<nghttp2_nv> nva;
  nva.reserve(fields.size() + 5);
  if (request) {
    // Pseudo-headers first (RFC 9113 §8.3), in the customary order.
    nva.push_back(make_nv(":method", request->method, NGHTTP2_NV_FLAG_NONE));
    nva.push_back(make_nv(":scheme", request->scheme, NGHTTP2_NV_FLAG_NONE));
    nva.push_back(make_nv(":authority", request->authority, NGHTTP2_NV_FLAG_NONE));
    nva.push_back(make_nv(":path", request->path, NGHTTP2_NV_FLAG_NONE));
    // Extended CONNECT (RFC 8441): without it the sandbox would see a plain CONNECT, which it must refuse.
    if (!request->protocol.empty()) nva.push_back(make_nv(":protocol", request->protocol, NGHTTP2_NV_FLAG_NONE));
  }
  // "Never indexed" for every regular field: our table is empty anyway, and it keeps the marks a client put on
  // sensitive fields (RFC 7541 §7.1.3 asks intermediaries to) without tracking which ones it marked.
  for (const HttpHeader& f : fields) nva.push_back(make_nv(f.name, f.value, NGHTTP2_NV_FLAG_NO_INDEX));
  std::string block(nghttp2_hd_deflate_bound(deflater_.get(), nva.data(), nva.size()), '\0');
  const ssize_t n = nghttp2_hd_deflate_hd(deflater_.get(), reinterpret_cast<uint8_t*>(block.data()), block.size(),
                                          nva.data(), nva.size());
  if (n < 0) return fail(Error::kInternal, "HPACK encoding failed: " + std::string(nghttp2_strerror(static_cast<int>(n))));
  block.resize(static_cast<size_t>(n));
  append_header_block(to_sandbox, stream_id, end_stream, block);
  return {};
}

Status H2ClientFilter::refuse(uint32_t stream_id, int status, bool end_stream, std::string& to_client) {
  if (status < 200 || status > 599)
    return fail(Error::kInternal, "h2 filter: refusal status " + std::to_string(status) + " is not a final status");
  append_frame(to_client, kHeaders, kFlagEndStream | kFlagEndHeaders, stream_id, refusal_block(status));
  if (!end_stream) {
    // RFC 9113 §8.1: a complete response before the whole request, then RST_STREAM(NO_ERROR) so the client
    // stops sending its body.
    std::string code;
    append_u32(code, static_cast<uint32_t>(H2ErrorCode::kNoError));
    append_frame(to_client, kRstStream, 0, stream_id, code);
  }
  refused_.push_back(stream_id);
  if (refused_.size() > limits_.max_refused_streams)
    refused_.erase(refused_.begin(), refused_.end() - static_cast<ptrdiff_t>(limits_.max_refused_streams));
  return {};
}

bool H2ClientFilter::is_refused(uint32_t stream_id) const {
  return std::binary_search(refused_.begin(), refused_.end(), stream_id);
}

// --- H2ServerFrames ---

Status H2ServerFrames::inject(std::string_view frames) {
  if (frames.size() > max_queued_bytes_ - queue_.size())
    return fail(Error::kLimitExceeded, "HTTP/2: more than " + std::to_string(max_queued_bytes_) +
                                           " bytes of the proxy's frames wait for the sandbox to reach a frame boundary");
  queue_.append(frames);
  return {};
}

Result<std::optional<uint32_t>> H2ServerFrames::feed(std::string_view in, std::string& out) {
  if (failed_) return *failed_;
  std::optional<uint32_t> announced;
  flush(out);
  while (!in.empty()) {
    if (header_len_ < kFrameHeaderBytes) {
      const size_t n = std::min(in.size(), kFrameHeaderBytes - header_len_);
      std::memcpy(header_.data() + header_len_, in.data(), n);
      out.append(in.substr(0, n));
      header_len_ += n;
      in.remove_prefix(n);
      if (header_len_ < kFrameHeaderBytes) break;
      frame_ = read_frame_header(std::string_view(header_.data(), header_.size()));
      payload_left_ = frame_.length;
      if (Status s = start_frame(); !s) {
        failed_ = s.failure();
        return *failed_;
      }
      if (payload_left_ == 0) end_frame(announced, out);
      continue;
    }
    const std::string_view chunk = in.substr(0, std::min(in.size(), payload_left_));
    out.append(chunk);
    if (in_settings_) {
      for (char c : chunk) {
        entry_[entry_len_++] = c;
        if (entry_len_ < entry_.size()) continue;
        entry_len_ = 0;
        const auto b = [&](size_t i) { return static_cast<uint32_t>(static_cast<uint8_t>(entry_[i])); };
        const uint32_t id = (b(0) << 8) | b(1);
        const uint32_t value = (b(2) << 24) | (b(3) << 16) | (b(4) << 8) | b(5);
        if (id == kSettingsHeaderTableSize) frame_table_size_ = value;
        if (id == kSettingsEnableConnectProtocol) frame_connect_protocol_ = value;
      }
    }
    payload_left_ -= chunk.size();
    in.remove_prefix(chunk.size());
    if (payload_left_ == 0) end_frame(announced, out);
  }
  return announced;
}

Status H2ServerFrames::start_frame() {
  const FrameHeader& h = frame_;
  if (!frame_seen_) {
    frame_seen_ = true;
    if (h.type != kSettings || (h.flags & kFlagAck))
      return protocol_error("the sandbox's first frame is " + std::string(frame_name(h.type)) + ", not SETTINGS");
  }
  if (block_open_) {
    if (h.type != kContinuation || h.stream_id != block_stream_)
      return protocol_error("the sandbox sent " + std::string(frame_name(h.type)) + " inside the header block of stream " +
                            std::to_string(block_stream_));
    if (h.flags & kFlagEndHeaders) block_open_ = false;
    return {};
  }
  switch (h.type) {
    case kContinuation:
      return protocol_error("the sandbox sent CONTINUATION without a preceding HEADERS or PUSH_PROMISE");
    case kHeaders:
    case kPushPromise:
      if (!(h.flags & kFlagEndHeaders)) {
        block_open_ = true;
        block_stream_ = h.stream_id;
      }
      return {};
    case kSettings:
      if (h.stream_id != 0) return protocol_error("the sandbox sent SETTINGS on a stream");
      if (h.flags & kFlagAck) {
        if (h.length != 0) return protocol_error("the sandbox sent a SETTINGS ACK with a payload");
        return {};
      }
      if (h.length % kSettingsEntryBytes != 0)
        return protocol_error("the sandbox sent a SETTINGS payload that is not a multiple of 6 bytes");
      in_settings_ = true;
      entry_len_ = 0;
      frame_table_size_.reset();
      frame_connect_protocol_.reset();
      return {};
    default:
      return {};
  }
}

void H2ServerFrames::end_frame(std::optional<uint32_t>& announced, std::string& out) {
  header_len_ = 0;
  first_frame_done_ = true;
  if (in_settings_) {
    in_settings_ = false;
    // The client applies SETTINGS once the frame is complete, so that is when the value counts.
    if (frame_table_size_) announced = std::max(announced.value_or(0), *frame_table_size_);
    extended_connect_ = extended_connect_.value_or(false) || frame_connect_protocol_ == 1u;
  }
  flush(out);
}

void H2ServerFrames::flush(std::string& out) {
  if (!first_frame_done_ || block_open_ || header_len_ != 0 || queue_.empty()) return;
  out.append(queue_);
  release(queue_);
}

}  // namespace sg
