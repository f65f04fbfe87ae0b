// HTTP/1.1 request body framing: a Content-Length, or the chunked transfer coding (RFC 9112 §7.1). The
// head goes through HttpParser; bodies are decoded here so that an upload streams to disk instead of being
// held in memory.
#pragma once

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <functional>
#include <string_view>

#include "common/error.h"

namespace sg::agent {

class BodyDecoder {
 public:
  static BodyDecoder fixed(uint64_t length);
  static BodyDecoder chunked();

  // Consumes what it can of `input`, handing body bytes to `sink`; returns how much was consumed. Stops at
  // the end of the body: what follows belongs to the next request.
  Result<size_t> decode(std::string_view input, const std::function<void(std::string_view)>& sink);
  bool done() const { return state_ == State::kDone; }

 private:
  enum class State { kData, kSize, kExtension, kSizeLf, kDataCr, kDataLf, kTrailerStart, kTrailer, kTrailerLf,
                     kFinalLf, kDone };
  explicit BodyDecoder(State s) : state_(s) {}

  State state_;
  bool chunked_ = false;
  uint64_t remaining_ = 0;  // of the body (fixed) or of the current chunk
  size_t size_digits_ = 0;
  size_t extension_bytes_ = 0;
  size_t trailer_bytes_ = 0;
};

}  // namespace sg::agent
