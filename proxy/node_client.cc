#include "proxy/node_client.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <string_view>
#include <vector>

#include "common/http_client.h"

namespace sg {
namespace {

template <typename Handle>
void close_and_free(Handle* h) {
  if (h == nullptr) return;
  uv_close(reinterpret_cast<uv_handle_t*>(h), [](uv_handle_t* handle) { delete reinterpret_cast<Handle*>(handle); });
}

// `extra_headers` arrives as raw "Name: value\r\n" lines (node_client.h); split, they go through the request
// builder's checks like every other header, so a malformed one is refused instead of sent.
Result<std::vector<HttpHeader>> split_header_lines(std::string_view raw) {
  std::vector<HttpHeader> out;
  while (!raw.empty()) {
    size_t eol = raw.find("\r\n");
    if (eol == std::string_view::npos) return fail(Error::kInvalidArgument, "extra header without CRLF");
    std::string_view line = raw.substr(0, eol);
    raw.remove_prefix(eol + 2);
    size_t colon = line.find(':');
    if (colon == std::string_view::npos) return fail(Error::kInvalidArgument, "extra header without a colon");
    std::string_view value = line.substr(colon + 1);
    while (value.starts_with(' ')) value.remove_prefix(1);
    out.push_back({std::string(line.substr(0, colon)), std::string(value)});
  }
  return out;
}

// The node calls are POSTs of JSON; a POST carries a Content-Length even when empty (the node wants one).
Result<std::string> request_bytes(const std::string& method, const std::string& path, const std::string& body,
                                  const std::string& extra_headers) {
  auto extra = split_header_lines(extra_headers);
  if (!extra) return extra.failure();
  const bool post = method == "POST";
  HttpRequest r{.method = method, .target = path, .host = "sandgate-node", .headers = {{"Connection", "close"}},
                .body = body, .content_length_when_empty = post};
  r.headers.insert(r.headers.end(), extra->begin(), extra->end());
  if (!body.empty() || post) r.headers.push_back({"Content-Type", "application/json"});
  return build_http_request(r);
}

}  // namespace

std::unique_ptr<NodeRequest> NodeRequest::start(uv_loop_t* loop, SocketWatchSet* sockets, const Endpoint& node,
                                                std::string method,
                                                std::string path, std::string body, uint32_t timeout_ms,
                                                std::string extra_headers, Callback done) {
  std::unique_ptr<NodeRequest> req(new NodeRequest());
  req->loop_ = loop;
  req->done_ = std::move(done);
  Result<std::string> wire = request_bytes(method, path, body, extra_headers);
  if (wire) req->out_ = std::move(*wire);

  req->timer_ = new uv_timer_t;
  uv_timer_init(loop, req->timer_);
  req->timer_->data = req.get();

  auto sa = to_sockaddr(node);
  int fd = -1;
  if (!wire) {
    // A request we refuse to send: reported from the loop like a connect failure, as promised.
    req->connect_failure_ = fail(wire.error(), "request to sandgate-node " + path + ": " + wire.message());
    timeout_ms = 0;
  } else if (fd = sa ? ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0) : -1;
             fd < 0 || ::connect(fd, sa->get(), sa->len) != 0) {
    int err = errno;
    if (fd >= 0) ::close(fd);
    // Delivered from the loop (timer 0), as promised, not from inside start().
    req->connect_failure_ = fail(Error::kUnavailable,
                                 "cannot reach sandgate-node at " + node.to_string() + ": " + std::strerror(err));
    timeout_ms = 0;
  } else {
    req->fd_.reset(fd);
    req->watch_.init(sockets, fd, [](void* self, int status, int ev) {
      static_cast<NodeRequest*>(self)->on_io(status, ev);
    }, req.get());
    if (Status s = req->arm(UV_WRITABLE); !s) {
      req->connect_failure_ = fail(Error::kUnavailable, "request to sandgate-node " + path + ": " + s.message());
      timeout_ms = 0;
    }
  }
  uv_timer_start(
      req->timer_,
      [](uv_timer_t* t) {
        auto* self = static_cast<NodeRequest*>(t->data);
        if (self->connect_failure_) return self->finish(*self->connect_failure_);
        self->finish(fail(Error::kTimeout, "sandgate-node did not answer in time"));
      },
      timeout_ms, 0);
  return req;
}

std::unique_ptr<NodeRequest> NodeRequest::stream(uv_loop_t* loop, SocketWatchSet* sockets, const Endpoint& node,
                                                 std::string path, uint32_t head_timeout_ms, LineCallback on_line,
                                                 Callback ended) {
  auto req = start(loop, sockets, node, "GET", std::move(path), "", head_timeout_ms, "", std::move(ended));
  req->on_line_ = std::move(on_line);
  req->parser_ = std::make_unique<HttpParser>(HttpParser::Kind::kResponse, HttpLimits{16 * 1024, 0, true});
  return req;
}

bool NodeRequest::deliver_lines(std::string_view bytes) {
  while (!bytes.empty()) {
    size_t eol = bytes.find('\n');
    if (eol == std::string_view::npos) {
      partial_line_.append(bytes);
      if (partial_line_.size() > kMaxStreamLineBytes) {
        finish(fail(Error::kLimitExceeded, "sandgate-node sent an event line over the limit"));
        return false;
      }
      return true;
    }
    partial_line_.append(bytes.substr(0, eol));
    bytes.remove_prefix(eol + 1);
    std::string line = std::move(partial_line_);
    partial_line_.clear();
    bool alive = true;
    alive_ = &alive;
    on_line_(line);  // may destroy *this
    if (!alive) return false;
    alive_ = nullptr;
    if (finished_) return false;
  }
  return true;
}

NodeRequest::~NodeRequest() {
  if (alive_ != nullptr) *alive_ = false;
  watch_.stop();
  close_and_free(timer_);
}

Status NodeRequest::arm(int events) { return watch_.set(events); }

void NodeRequest::on_io(int status, int events) {
  if (status < 0) return finish(fail(Error::kIo, std::string("node socket: ") + uv_strerror(status)));
  if ((events & UV_WRITABLE) && out_off_ < out_.size()) {
    ssize_t n = ::send(fd_.get(), out_.data() + out_off_, out_.size() - out_off_, MSG_NOSIGNAL);
    if (n < 0 && errno != EAGAIN) return finish(fail_errno("send to sandgate-node", errno));
    if (n > 0) out_off_ += static_cast<size_t>(n);
    if (out_off_ == out_.size()) {
      if (Status s = arm(UV_READABLE); !s) return finish(fail(Error::kIo, "node socket: " + s.message()));
    }
    return;
  }
  if (!(events & UV_READABLE)) return;
  char buf[8192];
  for (;;) {
    bool would_block = false;
    auto n = recv_with_fds(fd_.get(), buf, sizeof buf, &passed_fds_, &would_block);
    if (!n) return finish(n.failure());
    if (would_block) return;
    if (streaming_) {
      if (*n == 0) return finish(fail(Error::kUnavailable, "sandgate-node closed the event stream"));
      if (!deliver_lines(std::string_view(buf, *n))) return;
      continue;
    }
    HttpParser::State st = *n == 0 ? parser_->finish() : parser_->feed(buf, *n);
    if (on_line_ && st == HttpParser::State::kHeadComplete) {
      if (parser_->message().status != 200) {
        NodeResponse r;
        r.status = parser_->message().status;
        r.body.assign(buf + parser_->consumed(), *n - parser_->consumed());
        return finish(std::move(r));
      }
      // Up: the head's deadline no longer applies; the stream lasts until either side ends it.
      streaming_ = true;
      uv_timer_stop(timer_);
      if (!deliver_lines(std::string_view(buf + parser_->consumed(), *n - parser_->consumed()))) return;
      continue;
    }
    if (st == HttpParser::State::kError)
      return finish(fail(Error::kUnavailable, "bad answer from sandgate-node: " + parser_->failure().message));
    if (st == HttpParser::State::kMessageComplete) {
      NodeResponse r;
      r.status = parser_->message().status;
      r.body = std::move(parser_->message().body);
      r.passed_fds = std::move(passed_fds_);
      return finish(std::move(r));
    }
  }
}

void NodeRequest::finish(Result<NodeResponse> r) {
  if (finished_) return;
  finished_ = true;
  watch_.stop();
  uv_timer_stop(timer_);
  fd_.reset();
  Callback done = std::move(done_);
  done(std::move(r));  // may destroy *this; nothing touches members afterwards
}

}  // namespace sg
