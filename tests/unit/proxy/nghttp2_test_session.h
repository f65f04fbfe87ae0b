// A real nghttp2 session for the HTTP/2 unit tests, client or server, run in memory: the test moves its
// output (take_output) and feeds it bytes (receive), and the session records what it parsed per stream.
// Also the small wire helpers both HTTP/2 tests build frames with.
//
// Header-only; everything is inline, so several test files of one binary can include it.
#pragma once

#include <gtest/gtest.h>
#include <nghttp2/nghttp2.h>
#include <sys/types.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "common/http.h"

namespace sg::test_support {

inline constexpr std::string_view kPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

inline uint8_t* bytes_of(const std::string& s) { return reinterpret_cast<uint8_t*>(const_cast<char*>(s.data())); }

inline std::vector<nghttp2_nv> to_nva(const std::vector<HttpHeader>& fields) {
  std::vector<nghttp2_nv> nva;
  for (const HttpHeader& f : fields)
    nva.push_back({bytes_of(f.name), bytes_of(f.value), f.name.size(), f.value.size(), NGHTTP2_NV_FLAG_NONE});
  return nva;
}

inline const std::string* field(const std::vector<HttpHeader>& fields, std::string_view name) {
  for (const HttpHeader& f : fields)
    if (f.name == name) return &f.value;
  return nullptr;
}

// One frame laid out by hand: 9-byte header, then the payload as given.
inline std::string frame(uint8_t type, uint8_t flags, uint32_t stream_id, std::string_view payload) {
  std::string out;
  const auto length = static_cast<uint32_t>(payload.size());
  for (int shift : {16, 8, 0}) out.push_back(static_cast<char>(length >> shift));
  out.push_back(static_cast<char>(type));
  out.push_back(static_cast<char>(flags));
  for (int shift : {24, 16, 8, 0}) out.push_back(static_cast<char>(stream_id >> shift));
  out.append(payload);
  return out;
}

inline std::string settings_frame() { return frame(NGHTTP2_SETTINGS, 0, 0, {}); }

// Serves `rest` to nghttp2 as a request or response body; with `trailers`, ends the stream with them.
struct BodySource {
  std::string_view rest;
  std::vector<HttpHeader> trailers;
};

inline nghttp2_data_provider body_provider(BodySource* source) {
  nghttp2_data_provider provider{};
  provider.source.ptr = source;
  provider.read_callback = [](nghttp2_session* session, int32_t stream_id, uint8_t* buf, size_t length,
                              uint32_t* flags, nghttp2_data_source* src, void*) -> ssize_t {
    auto* body = static_cast<BodySource*>(src->ptr);
    const size_t n = std::min(length, body->rest.size());
    std::copy_n(body->rest.data(), n, buf);
    body->rest.remove_prefix(n);
    if (body->rest.empty()) {
      *flags |= NGHTTP2_DATA_FLAG_EOF;
      if (!body->trailers.empty()) {
        *flags |= NGHTTP2_DATA_FLAG_NO_END_STREAM;
        std::vector<nghttp2_nv> nva = to_nva(body->trailers);
        if (nghttp2_submit_trailer(session, stream_id, nva.data(), nva.size()) != 0) return NGHTTP2_ERR_CALLBACK_FAILURE;
      }
    }
    return static_cast<ssize_t>(n);
  };
  return provider;
}

// What the server role answers every request with (besides the body).
inline const std::vector<HttpHeader> kResponseFields = {
    {":status", "200"},
    {"content-type", "text/plain; charset=utf-8"},
    {"x-sandbox-trace", "sandbox-response-trace-value-that-the-encoder-indexes"},
    {"set-cookie", "app_session=0123456789abcdef; Path=/; Secure; HttpOnly"}};

// A real nghttp2 session, client or server, that sends `settings` first. The server answers every complete
// request with kResponseFields and a body naming the path (fields it repeats on every response, so the
// client's HPACK decoder depends on the server's dynamic table: a proxy frame that disturbed that table would
// break the next response).
class Nghttp2Session {
 public:
  enum class Role { kClient, kServer };
  struct Stream {
    std::vector<HttpHeader> headers;
    std::vector<HttpHeader> trailers;
    std::string data;
    bool headers_done = false;
    bool end_stream = false;
    bool closed = false;
    uint32_t close_error = 0;
    BodySource response;
    std::string response_body;
  };

  explicit Nghttp2Session(Role role, std::vector<nghttp2_settings_entry> settings = {}) : role_(role) {
    nghttp2_session_callbacks* callbacks = nullptr;
    nghttp2_session_callbacks_new(&callbacks);
    nghttp2_session_callbacks_set_on_header_callback(callbacks, on_header);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(callbacks, on_data_chunk);
    nghttp2_session_callbacks_set_on_frame_recv_callback(callbacks, on_frame);
    nghttp2_session_callbacks_set_on_stream_close_callback(callbacks, on_stream_close);
    if (role == Role::kClient) nghttp2_session_client_new(&session_, callbacks, this);
    else nghttp2_session_server_new(&session_, callbacks, this);
    nghttp2_session_callbacks_del(callbacks);
    nghttp2_submit_settings(session_, NGHTTP2_FLAG_NONE, settings.data(), settings.size());
  }
  ~Nghttp2Session() { nghttp2_session_del(session_); }
  Nghttp2Session(const Nghttp2Session&) = delete;
  Nghttp2Session& operator=(const Nghttp2Session&) = delete;

  nghttp2_session* get() { return session_; }

  // Client role: submits a request, with `body` (and its trailers) if given; returns the stream id.
  int32_t submit(const std::vector<HttpHeader>& fields, BodySource* body = nullptr) {
    std::vector<nghttp2_nv> nva = to_nva(fields);
    nghttp2_data_provider provider = body ? body_provider(body) : nghttp2_data_provider{};
    return nghttp2_submit_request(session_, nullptr, nva.data(), nva.size(), body ? &provider : nullptr, nullptr);
  }

  // Everything the session has to send now.
  std::string take_output() {
    std::string out;
    for (;;) {
      const uint8_t* data = nullptr;
      const ssize_t n = nghttp2_session_mem_send(session_, &data);
      EXPECT_GE(n, 0);
      if (n <= 0) return out;
      out.append(reinterpret_cast<const char*>(data), static_cast<size_t>(n));
    }
  }

  // What nghttp2_session_mem_recv returns: the bytes it accepted, or a negative error.
  ssize_t receive(std::string_view bytes) {
    return nghttp2_session_mem_recv(session_, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }

  std::map<int32_t, Stream> streams;
  bool goaway = false;
  int32_t goaway_last_stream = -1;
  uint32_t goaway_error = 0;
  std::string goaway_debug;

 private:
  static Nghttp2Session* self(void* p) { return static_cast<Nghttp2Session*>(p); }
  static int on_header(nghttp2_session*, const nghttp2_frame* frame, const uint8_t* name, size_t namelen,
                       const uint8_t* value, size_t valuelen, uint8_t, void* user) {
    Stream& s = self(user)->streams[frame->hd.stream_id];
    (s.headers_done ? s.trailers : s.headers)
        .push_back({std::string(reinterpret_cast<const char*>(name), namelen),
                    std::string(reinterpret_cast<const char*>(value), valuelen)});
    return 0;
  }
  static int on_data_chunk(nghttp2_session*, uint8_t, int32_t stream_id, const uint8_t* data, size_t len, void* user) {
    self(user)->streams[stream_id].data.append(reinterpret_cast<const char*>(data), len);
    return 0;
  }
  static int on_frame(nghttp2_session* session, const nghttp2_frame* frame, void* user) {
    Nghttp2Session* me = self(user);
    if (frame->hd.type == NGHTTP2_GOAWAY) {
      me->goaway = true;
      me->goaway_last_stream = frame->goaway.last_stream_id;
      me->goaway_error = frame->goaway.error_code;
      me->goaway_debug.assign(reinterpret_cast<const char*>(frame->goaway.opaque_data), frame->goaway.opaque_data_len);
    }
    if (frame->hd.type != NGHTTP2_HEADERS && frame->hd.type != NGHTTP2_DATA) return 0;
    Stream& s = me->streams[frame->hd.stream_id];
    if (frame->hd.type == NGHTTP2_HEADERS) s.headers_done = true;
    if (!(frame->hd.flags & NGHTTP2_FLAG_END_STREAM)) return 0;
    s.end_stream = true;
    if (me->role_ == Role::kServer) {
      const std::string* path = field(s.headers, ":path");
      s.response_body = "served " + (path ? *path : std::string("?"));
      s.response.rest = s.response_body;
      std::vector<nghttp2_nv> nva = to_nva(kResponseFields);
      nghttp2_data_provider provider = body_provider(&s.response);
      if (nghttp2_submit_response(session, frame->hd.stream_id, nva.data(), nva.size(), &provider) != 0)
        return NGHTTP2_ERR_CALLBACK_FAILURE;
    }
    return 0;
  }
  static int on_stream_close(nghttp2_session*, int32_t stream_id, uint32_t error_code, void* user) {
    self(user)->streams[stream_id].closed = true;
    self(user)->streams[stream_id].close_error = error_code;
    return 0;
  }

  Role role_;
  nghttp2_session* session_ = nullptr;
};

// The fuzz tests' mutations of a seed: 1 to 4 random edits (set a byte, flip a bit, insert, erase, truncate,
// and with `duplicate_slices` also repeat a slice: replayed frames and HPACK), all drawn from `rng`, so a
// fixed seed replays the same inputs.
inline std::string mutate(std::mt19937& rng, std::string input, bool duplicate_slices) {
  auto pick = [&](size_t n) { return n == 0 ? 0 : std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  const size_t mutations = 1 + pick(4);
  for (size_t m = 0; m < mutations && !input.empty(); ++m) {
    const size_t at = pick(input.size());
    switch (pick(duplicate_slices ? 6 : 5)) {
      case 0: input[at] = static_cast<char>(pick(256)); break;
      case 1: input[at] = static_cast<char>(input[at] ^ (1 << pick(8))); break;
      case 2: input.insert(at, std::string(1 + pick(16), static_cast<char>(pick(256)))); break;
      case 3: input.erase(at, 1 + pick(16)); break;
      case 4: input.resize(pick(input.size() + 1)); break;
      default: {
        const size_t len = 1 + pick(64);
        input.insert(at, input.substr(pick(input.size()), len));
        break;
      }
    }
  }
  return input;
}

}  // namespace sg::test_support
