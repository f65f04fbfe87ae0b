#include "agent/server.h"

#include <cstdio>
#include <vector>

#include "agent/connection.h"

namespace sg::agent {
namespace {

constexpr size_t kReadBufferBytes = 64 * 1024;
constexpr uint64_t kLingerMs = 2'000;
constexpr std::string_view kH2Preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

struct WriteReq {
  uv_write_t req;
  std::string data;
};

}  // namespace

// ---- connection ----

Connection::Connection(AgentServer& server)
    : server_(server), read_buf_(std::make_unique<char[]>(kReadBufferBytes)) {}

Status Connection::accept(uv_stream_t* listener) {
  uv_loop_t* loop = server_.loop_;
  uv_tcp_init(loop, &tcp_);
  uv_idle_init(loop, &soon_);
  uv_timer_init(loop, &linger_);
  for (uv_handle_t* h : {reinterpret_cast<uv_handle_t*>(&tcp_), reinterpret_cast<uv_handle_t*>(&soon_),
                         reinterpret_cast<uv_handle_t*>(&linger_)}) {
    h->data = this;
    ++open_handles_;
  }
  if (int rc = uv_accept(listener, stream()); rc < 0) {
    close_now();
    return fail(Error::kIo, std::string("accept: ") + uv_strerror(rc));
  }
  uv_tcp_nodelay(&tcp_, 1);  // streamed exec output must not wait for an ACK (Nagle)
  set_reading(true);
  return {};
}

Router& Connection::router() { return server_.router_; }
const AgentLimits& Connection::limits() const { return server_.router_.limits(); }

size_t Connection::write_queue_bytes() const { return uv_stream_get_write_queue_size(stream()); }

void Connection::set_reading(bool on) {
  if (on == reading_ || closing_) return;
  if (on && peer_eof_) return;
  reading_ = on;
  if (!on) {
    uv_read_stop(stream());
    return;
  }
  uv_read_start(
      stream(),
      [](uv_handle_t* h, size_t, uv_buf_t* buf) {
        auto* self = static_cast<Connection*>(h->data);
        *buf = uv_buf_init(self->read_buf_.get(), kReadBufferBytes);
      },
      [](uv_stream_t* s, ssize_t nread, const uv_buf_t* buf) { static_cast<Connection*>(s->data)->on_read(nread, buf); });
}

void Connection::on_read(ssize_t nread, const uv_buf_t* buf) {
  if (closing_ || nread == 0) return;
  if (nread < 0) {
    if (nread != UV_EOF || draining_ || ending_ || protocol_ == nullptr) return close_now();
    peer_eof_ = true;
    reading_ = false;
    uv_read_stop(stream());
    return protocol_->on_eof();
  }
  if (draining_ || ending_) return;
  std::string_view data(buf->base, static_cast<size_t>(nread));
  if (protocol_ != nullptr) return protocol_->on_input(data);
  sniffed_.append(data);
  choose_protocol();
}

// The h2c preface is only looked for at the start of a connection (RFC 9113 §3.3): until it has fully
// arrived or diverged, the bytes wait.
void Connection::choose_protocol() {
  size_t n = std::min(sniffed_.size(), kH2Preface.size());
  bool preface_so_far = std::string_view(sniffed_).substr(0, n) == kH2Preface.substr(0, n);
  if (preface_so_far && n < kH2Preface.size()) return;
  protocol_ = preface_so_far ? make_http2(*this) : make_http1(*this);
  std::string first = std::move(sniffed_);
  sniffed_.clear();
  protocol_->on_input(first);
}

void Connection::write(std::string bytes) {
  if (closing_ || bytes.empty()) return;
  auto* req = new WriteReq;
  req->data = std::move(bytes);
  req->req.data = this;
  uv_buf_t buf = uv_buf_init(req->data.data(), static_cast<unsigned>(req->data.size()));
  int rc = uv_write(&req->req, stream(), &buf, 1, [](uv_write_t* w, int status) {
    auto* self = static_cast<Connection*>(w->data);
    delete reinterpret_cast<WriteReq*>(w);
    // Cancelled writes complete before the close callback, so `self` is still alive here.
    if (self->closing_) return;
    if (status < 0) return self->close_now();
    self->protocol_->on_written();
  });
  if (rc < 0) {
    delete req;
    close_now();
  }
}

void Connection::schedule() {
  if (closing_ || uv_is_active(reinterpret_cast<uv_handle_t*>(&soon_))) return;
  uv_idle_start(&soon_, [](uv_idle_t* h) {
    uv_idle_stop(h);
    auto* self = static_cast<Connection*>(h->data);
    if (!self->closing_ && self->protocol_ != nullptr) self->protocol_->on_soon();
  });
}

void Connection::end_after_writes() {
  if (ending_ || closing_) return;
  ending_ = true;
  auto* req = new uv_shutdown_t;
  req->data = this;
  int rc = uv_shutdown(req, stream(), [](uv_shutdown_t* r, int status) {
    auto* self = static_cast<Connection*>(r->data);
    delete r;
    if (self->closing_) return;
    if (status < 0 || self->peer_eof_) return self->close_now();
    self->draining_ = true;
    self->set_reading(true);
    uv_timer_start(&self->linger_, [](uv_timer_t* t) { static_cast<Connection*>(t->data)->close_now(); }, kLingerMs, 0);
  });
  if (rc < 0) {
    delete req;
    close_now();
  }
}

void Connection::close_now() {
  if (closing_) return;
  closing_ = true;
  if (protocol_ != nullptr) protocol_->on_close();
  for (uv_handle_t* h : {reinterpret_cast<uv_handle_t*>(&tcp_), reinterpret_cast<uv_handle_t*>(&soon_),
                         reinterpret_cast<uv_handle_t*>(&linger_)})
    uv_close(h, [](uv_handle_t* handle) { static_cast<Connection*>(handle->data)->on_handle_closed(); });
}

void Connection::on_handle_closed() {
  if (--open_handles_ > 0) return;
  server_.connections_.erase(this);
  delete this;
}

// ---- server ----

AgentServer::AgentServer(uv_loop_t* loop, AgentLimits limits) : loop_(loop), router_(loop, limits) {}

AgentServer::~AgentServer() = default;

Result<uint16_t> listen_tcp(uv_loop_t* loop, uv_tcp_t* handle, const Endpoint& ep, int backlog,
                            uv_connection_cb on_connection) {
  uv_tcp_init(loop, handle);
  if (ep.kind != Endpoint::Kind::kTcp) return fail(Error::kInvalidArgument, "the agent listens on TCP only");
  auto fd = listen_on(ep, false, backlog);
  if (!fd) return fd.failure();
  auto port = local_port(fd->get());
  if (!port) return port.failure();
  int rc = uv_tcp_open(handle, fd->get());
  if (rc == 0) {
    fd->release();  // the handle owns it now
    rc = uv_listen(reinterpret_cast<uv_stream_t*>(handle), backlog, on_connection);
  }
  if (rc < 0) return fail(Error::kIo, "listen " + ep.to_string() + ": " + uv_strerror(rc));
  return *port;
}

Status AgentServer::listen(const Endpoint& ep) {
  listening_ = true;  // initialised by listen_tcp whatever happens: close() closes it
  auto port = listen_tcp(loop_, &listener_, ep, 1024,
                         [](uv_stream_t* s, int status) { static_cast<AgentServer*>(s->data)->on_connection(status); });
  listener_.data = this;  // read by the callback, which runs from the loop only
  if (!port) return port.failure();
  Endpoint bound = ep;
  bound.port = *port;
  address_ = bound.to_string();
  return {};
}

void AgentServer::on_connection(int status) {
  if (status < 0) {
    std::fprintf(stderr, "sandgate-agent: accept: %s\n", uv_strerror(status));
    return;
  }
  if (connections_.size() >= router_.limits().max_connections) {
    // Accept and close at once: left in the backlog, the client would wait instead of learning it must retry.
    auto* refused = new uv_tcp_t;
    uv_tcp_init(loop_, refused);
    uv_accept(reinterpret_cast<uv_stream_t*>(&listener_), reinterpret_cast<uv_stream_t*>(refused));
    uv_close(reinterpret_cast<uv_handle_t*>(refused), [](uv_handle_t* h) { delete reinterpret_cast<uv_tcp_t*>(h); });
    return;
  }
  auto* conn = new Connection(*this);
  connections_.insert(conn);
  if (auto s = conn->accept(reinterpret_cast<uv_stream_t*>(&listener_)); !s)
    std::fprintf(stderr, "sandgate-agent: %s\n", s.message().c_str());
}

void AgentServer::close() {
  if (closing_) return;
  closing_ = true;
  if (listening_) uv_close(reinterpret_cast<uv_handle_t*>(&listener_), nullptr);
  std::vector<Connection*> open(connections_.begin(), connections_.end());
  for (Connection* conn : open) conn->close_now();
  router_.close();
}

}  // namespace sg::agent
