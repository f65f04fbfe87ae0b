#include "agent/body_decoder.h"

namespace sg::agent {
namespace {

// 15 hex digits is over an exabyte and cannot overflow a uint64_t.
constexpr size_t kMaxSizeDigits = 15;
constexpr size_t kMaxExtensionBytes = 1024;
constexpr size_t kMaxTrailerBytes = 16 * 1024;

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

Failure malformed(std::string_view what) {
  return fail(Error::kInvalidArgument, "malformed chunked body: " + std::string(what));
}

}  // namespace

BodyDecoder BodyDecoder::fixed(uint64_t length) {
  BodyDecoder d(length == 0 ? State::kDone : State::kData);
  d.remaining_ = length;
  return d;
}

BodyDecoder BodyDecoder::chunked() {
  BodyDecoder d(State::kSize);
  d.chunked_ = true;
  return d;
}

Result<size_t> BodyDecoder::decode(std::string_view input, const std::function<void(std::string_view)>& sink) {
  size_t i = 0;
  while (i < input.size() && state_ != State::kDone) {
    char c = input[i];
    switch (state_) {
      case State::kData: {
        size_t n = static_cast<size_t>(std::min<uint64_t>(remaining_, input.size() - i));
        sink(input.substr(i, n));
        i += n;
        remaining_ -= n;
        if (remaining_ == 0) state_ = chunked_ ? State::kDataCr : State::kDone;
        continue;
      }
      case State::kSize: {
        int v = hex_value(c);
        if (v >= 0) {
          if (++size_digits_ > kMaxSizeDigits) return malformed("chunk size too large");
          remaining_ = remaining_ * 16 + static_cast<uint64_t>(v);
        } else if (size_digits_ == 0) {
          return malformed("expected a chunk size");
        } else if (c == ';' || c == ' ' || c == '\t') {
          state_ = State::kExtension;  // chunk extensions carry nothing we use
        } else if (c == '\r') {
          state_ = State::kSizeLf;
        } else {
          return malformed("bad character in chunk size");
        }
        break;
      }
      case State::kExtension:
        if (c == '\r')
          state_ = State::kSizeLf;
        else if (++extension_bytes_ > kMaxExtensionBytes)
          return malformed("chunk extension too long");
        break;
      case State::kSizeLf:
        if (c != '\n') return malformed("expected LF after the chunk size");
        state_ = remaining_ == 0 ? State::kTrailerStart : State::kData;
        size_digits_ = 0;
        extension_bytes_ = 0;
        break;
      case State::kDataCr:
        if (c != '\r') return malformed("expected CRLF after chunk data");
        state_ = State::kDataLf;
        break;
      case State::kDataLf:
        if (c != '\n') return malformed("expected CRLF after chunk data");
        state_ = State::kSize;
        break;
      case State::kTrailerStart:
        state_ = c == '\r' ? State::kFinalLf : State::kTrailer;
        [[fallthrough]];
      case State::kTrailer:
        if (++trailer_bytes_ > kMaxTrailerBytes) return malformed("trailer section too large");
        if (state_ == State::kTrailer && c == '\r') state_ = State::kTrailerLf;
        break;
      case State::kTrailerLf:
        if (c != '\n') return malformed("expected LF after a trailer field");
        state_ = State::kTrailerStart;
        break;
      case State::kFinalLf:
        if (c != '\n') return malformed("expected LF after the last chunk");
        state_ = State::kDone;
        break;
      case State::kDone:
        break;
    }
    ++i;
  }
  return i;
}

}  // namespace sg::agent
