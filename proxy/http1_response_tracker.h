// The sandbox -> client direction of an HTTP/1.1 route, watched (never changed): where each response ends,
// so the edge knows when the sandbox has answered every request it was given. Two things need that:
//   - a refused request (421 for another Host, 403, 400 ...) after forwarded ones is answered by the edge
//     right after the sandbox's answers to those, not when the sandbox closes the connection;
//   - an Upgrade (or CONNECT) request switches the connection to the new protocol only if the sandbox
//     accepts it (101, or 2xx to CONNECT); otherwise the requests after it are parsed and checked as usual.
// Heads are parsed with llhttp; a Content-Length body is counted, not parsed; chunked bodies are parsed for
// their framing; a body delimited by the close, and everything after a protocol switch, is not looked at.
// What is only counted need not be seen at all: unseen_allowed() says how many of the next bytes may pass
// without being shown (spliced), and skip() counts them, so a kTLS connection splices response bodies and
// copies only heads and chunk framing.
#pragma once

#include <llhttp.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace sg {

class Http1ResponseTracker {
 public:
  enum class State {
    kHead,        // between responses or inside a head / chunked body (llhttp reads)
    kFixedBody,   // inside a Content-Length body: counted
    kUntilClose,  // the response's body ends with the connection
    kSwitched,    // the sandbox accepted an Upgrade / CONNECT: the rest is another protocol
    kLost,        // the sandbox's bytes are not HTTP/1.1 (or a response without a request): not followed
  };

  Http1ResponseTracker();
  Http1ResponseTracker(const Http1ResponseTracker&) = delete;
  Http1ResponseTracker& operator=(const Http1ResponseTracker&) = delete;

  // A request went to the sandbox (in order): its method decides whether the response has a body (HEAD) or
  // what switches (CONNECT); `upgrade` that it asks to switch protocols.
  void expect(std::string_view method, bool upgrade);
  // Bytes the sandbox sent, in order, each exactly once (observed or skipped).
  void observe(std::string_view bytes);
  // How many of the sandbox's next bytes the tracker needs not see: the rest of a Content-Length body or of
  // a chunk's data, everything once the stream is not followed; 0 while a head or chunk framing comes.
  uint64_t unseen_allowed() const;
  // `n` (at most unseen_allowed()) bytes passed without being shown.
  void skip(uint64_t n);

  State state() const { return state_; }
  // Final responses received whole (1xx interim responses do not count; a switch counts as the answer).
  size_t answered() const { return answered_; }
  // Every request expect()ed has its whole answer, and nothing of a next response has begun.
  bool idle() const { return state_ == State::kHead && pending_.empty() && !in_message_; }
  // The sandbox's verdict on an Upgrade/CONNECT request, once the head of its answer is known (true =
  // switched), handed out once.
  std::optional<bool> take_upgrade_outcome();

 private:
  struct Request {
    bool head = false;
    bool connect = false;
    bool upgrade = false;
  };
  static int on_message_begin(llhttp_t* p);
  static int on_headers_complete(llhttp_t* p);
  static int on_message_complete(llhttp_t* p);
  static int on_chunk_header(llhttp_t* p);
  static int on_chunk_complete(llhttp_t* p);
  static const llhttp_settings_t* settings();
  void finish_response();
  // The Content-Length body's next n bytes (n <= fixed_left_) went by.
  void count_fixed_body(uint64_t n);

  llhttp_t parser_{};
  // Forwarded, not yet answered, oldest first. A vector, not a deque: libstdc++'s deque allocates 576 bytes
  // even empty, and a connection seldom has more than one request in flight.
  std::vector<Request> pending_;
  State state_ = State::kHead;
  uint64_t fixed_left_ = 0;
  size_t answered_ = 0;
  bool in_message_ = false;  // llhttp is inside a response (head or chunked body)
  bool interim_ = false;     // the response being read is 1xx (not the final answer)
  bool in_chunk_data_ = false;  // llhttp is inside a chunk's data (parser_.content_length bytes left)
  std::optional<bool> upgrade_outcome_;
};

}  // namespace sg
