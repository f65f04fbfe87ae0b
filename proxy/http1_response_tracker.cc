#include "proxy/http1_response_tracker.h"

#include <algorithm>

namespace sg {

// The same callbacks for every tracker: one table, not one per connection (llhttp keeps a pointer to it).
const llhttp_settings_t* Http1ResponseTracker::settings() {
  static const llhttp_settings_t table = [] {
    llhttp_settings_t s;
    llhttp_settings_init(&s);
    s.on_message_begin = &Http1ResponseTracker::on_message_begin;
    s.on_headers_complete = &Http1ResponseTracker::on_headers_complete;
    s.on_message_complete = &Http1ResponseTracker::on_message_complete;
    s.on_chunk_header = &Http1ResponseTracker::on_chunk_header;
    s.on_chunk_complete = &Http1ResponseTracker::on_chunk_complete;
    return s;
  }();
  return &table;
}

Http1ResponseTracker::Http1ResponseTracker() {
  // llhttp_init takes a non-const pointer but only reads the table.
  llhttp_init(&parser_, HTTP_RESPONSE, const_cast<llhttp_settings_t*>(settings()));
  parser_.data = this;
}

void Http1ResponseTracker::expect(std::string_view method, bool upgrade) {
  pending_.push_back({method == "HEAD", method == "CONNECT", upgrade || method == "CONNECT"});
}

int Http1ResponseTracker::on_message_begin(llhttp_t* p) {
  auto* self = static_cast<Http1ResponseTracker*>(p->data);
  self->in_message_ = true;
  return 0;
}

// The return value tells llhttp how the body is framed: 0 as the headers say, 1 no body, 2 no body and the
// protocol switches (HPE_PAUSED_UPGRADE); HPE_PAUSED stops parsing (the tracker takes over).
int Http1ResponseTracker::on_headers_complete(llhttp_t* p) {
  auto* self = static_cast<Http1ResponseTracker*>(p->data);
  const int status = llhttp_get_status_code(p);
  if (self->pending_.empty()) {  // an answer nobody asked for: the stream cannot be followed
    self->state_ = State::kLost;
    return HPE_PAUSED;
  }
  const Request& request = self->pending_.front();
  self->interim_ = status >= 100 && status < 200 && status != 101;
  if (self->interim_) return 0;  // llhttp knows 1xx have no body; the final answer follows
  if (request.upgrade) {
    const bool switched = request.connect ? status >= 200 && status < 300 : status == 101;
    self->upgrade_outcome_ = switched;
    if (switched) return 2;
  }
  if (request.head || status == 204 || status == 304) return 1;
  if (p->flags & F_CHUNKED) return 0;  // llhttp follows the chunks
  if (p->flags & F_CONTENT_LENGTH) {
    if (p->content_length == 0) return 1;
    // Counted by the tracker: llhttp is told there is no body and sees the next head only.
    self->fixed_left_ = p->content_length;
    self->state_ = State::kFixedBody;
    return 1;
  }
  if (llhttp_message_needs_eof(p)) {
    self->state_ = State::kUntilClose;
    return HPE_PAUSED;
  }
  return 1;
}

int Http1ResponseTracker::on_message_complete(llhttp_t* p) {
  auto* self = static_cast<Http1ResponseTracker*>(p->data);
  self->in_message_ = false;
  if (self->interim_) {
    self->interim_ = false;
    return 0;
  }
  // A Content-Length body is still to come: llhttp stops here (it was told there is no body, and would read
  // the body as the next head); the response is whole when the body has been counted.
  if (self->state_ == State::kFixedBody) return HPE_PAUSED;
  self->finish_response();
  return 0;
}

// llhttp has read a chunk's size line: parser_.content_length is its data's size, counted down as the data
// is consumed (0 for the last chunk).
int Http1ResponseTracker::on_chunk_header(llhttp_t* p) {
  static_cast<Http1ResponseTracker*>(p->data)->in_chunk_data_ = p->content_length > 0;
  return 0;
}

int Http1ResponseTracker::on_chunk_complete(llhttp_t* p) {
  static_cast<Http1ResponseTracker*>(p->data)->in_chunk_data_ = false;
  return 0;
}

void Http1ResponseTracker::finish_response() {
  if (!pending_.empty()) pending_.erase(pending_.begin());
  ++answered_;
}

std::optional<bool> Http1ResponseTracker::take_upgrade_outcome() {
  std::optional<bool> outcome = upgrade_outcome_;
  upgrade_outcome_.reset();
  return outcome;
}

void Http1ResponseTracker::observe(std::string_view bytes) {
  while (!bytes.empty()) {
    switch (state_) {
      case State::kUntilClose:
      case State::kSwitched:
      case State::kLost:
        return;
      case State::kFixedBody: {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(fixed_left_, bytes.size()));
        count_fixed_body(n);
        bytes.remove_prefix(n);
        break;
      }
      case State::kHead: {
        const llhttp_errno_t err = llhttp_execute(&parser_, bytes.data(), bytes.size());
        if (err == HPE_OK) return;
        const char* stop = llhttp_get_error_pos(&parser_);
        const size_t used = stop ? static_cast<size_t>(stop - bytes.data()) : bytes.size();
        bytes.remove_prefix(std::min(used, bytes.size()));
        if (err == HPE_PAUSED_UPGRADE) {  // the 101 (or 2xx to CONNECT) was the answer; what follows is not HTTP
          state_ = State::kSwitched;
          return;
        }
        if (err == HPE_PAUSED) {
          if (state_ == State::kFixedBody) {
            llhttp_resume(&parser_);
            continue;
          }
          return;  // kUntilClose or kLost, set by the callback
        }
        state_ = State::kLost;
        return;
      }
    }
  }
}

void Http1ResponseTracker::count_fixed_body(uint64_t n) {
  fixed_left_ -= n;
  if (fixed_left_ == 0) {
    state_ = State::kHead;
    finish_response();
  }
}

uint64_t Http1ResponseTracker::unseen_allowed() const {
  switch (state_) {
    case State::kUntilClose:
    case State::kSwitched:
    case State::kLost:
      return UINT64_MAX;
    case State::kFixedBody:
      return fixed_left_;
    case State::kHead:
      return in_chunk_data_ ? parser_.content_length : 0;
  }
  return 0;
}

void Http1ResponseTracker::skip(uint64_t n) {
  if (state_ == State::kFixedBody) return count_fixed_body(std::min(n, fixed_left_));
  if (state_ != State::kHead || !in_chunk_data_) return;
  // llhttp counts chunk data down without looking at it, so it is given as many placeholder bytes: the same
  // parser then reads the chunk's end and the framing after it from the real bytes.
  static const char kPlaceholder[16384] = {};
  n = std::min(n, parser_.content_length);
  while (n > 0) {
    const size_t piece = static_cast<size_t>(std::min<uint64_t>(n, sizeof kPlaceholder));
    if (llhttp_execute(&parser_, kPlaceholder, piece) != HPE_OK) {
      state_ = State::kLost;
      return;
    }
    n -= piece;
  }
}

}  // namespace sg
