// An h2c (HTTP/2 over cleartext TCP) backend for the end-to-end tests, on nghttp2's server session: every
// request's header fields are recorded exactly as the server decoded them. A request's answer is 200 with
// the fields of every request this server has received so far, one "stream <id> <name>: <value>" line each,
// so a test reads through the ingress what the sandbox's code was given (and what it never saw).
//   h2_recorder PORT [--extended-connect]
// --extended-connect: the server's SETTINGS enable extended CONNECT (SETTINGS_ENABLE_CONNECT_PROTOCOL = 1,
// RFC 8441), and a CONNECT is answered as soon as its HEADERS arrive (a WebSocket client keeps its stream
// open), with the same 200 and body, which ends the stream.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <nghttp2/nghttp2.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <thread>

namespace {

std::mutex seen_mu;
std::string seen;  // every request of every connection, in arrival order
bool extended_connect = false;

struct Connection {
  int fd = -1;
  nghttp2_session* session = nullptr;
  std::set<int32_t> connect_streams;  // streams whose :method is CONNECT
};

ssize_t send_cb(nghttp2_session*, const uint8_t* data, size_t len, int, void* user) {
  auto* c = static_cast<Connection*>(user);
  ssize_t n = ::send(c->fd, data, len, MSG_NOSIGNAL);
  return n < 0 ? static_cast<ssize_t>(NGHTTP2_ERR_CALLBACK_FAILURE) : n;
}

int header_cb(nghttp2_session*, const nghttp2_frame* frame, const uint8_t* name, size_t namelen, const uint8_t* value,
              size_t valuelen, uint8_t, void* user) {
  const std::string_view n(reinterpret_cast<const char*>(name), namelen);
  const std::string_view v(reinterpret_cast<const char*>(value), valuelen);
  if (n == ":method" && v == "CONNECT") static_cast<Connection*>(user)->connect_streams.insert(frame->hd.stream_id);
  std::lock_guard lock(seen_mu);
  seen += "stream " + std::to_string(frame->hd.stream_id) + " " + std::string(n) + ": " + std::string(v) + "\n";
  return 0;
}

ssize_t read_body(nghttp2_session*, int32_t, uint8_t* buf, size_t length, uint32_t* flags, nghttp2_data_source* source,
                  void*) {
  auto* body = static_cast<std::string*>(source->ptr);
  size_t n = std::min(length, body->size());
  std::copy(body->begin(), body->begin() + static_cast<long>(n), buf);
  body->erase(0, n);
  if (body->empty()) *flags |= NGHTTP2_DATA_FLAG_EOF;
  return static_cast<ssize_t>(n);
}

int frame_recv_cb(nghttp2_session* session, const nghttp2_frame* frame, void* user) {
  // Answer once the request is complete (END_STREAM on its HEADERS or last DATA), a CONNECT at its HEADERS.
  auto* c = static_cast<Connection*>(user);
  const bool connect = frame->hd.type == NGHTTP2_HEADERS && c->connect_streams.erase(frame->hd.stream_id) > 0;
  const bool complete = (frame->hd.type == NGHTTP2_HEADERS || frame->hd.type == NGHTTP2_DATA) &&
                        (frame->hd.flags & NGHTTP2_FLAG_END_STREAM);
  if (!connect && !complete) return 0;
  if (nghttp2_session_get_stream_user_data(session, frame->hd.stream_id) != nullptr) return 0;  // answered already
  std::string* body;
  {
    std::lock_guard lock(seen_mu);
    body = new std::string(seen);
  }
  nghttp2_session_set_stream_user_data(session, frame->hd.stream_id, body);
  const nghttp2_nv headers[] = {{(uint8_t*)":status", (uint8_t*)"200", 7, 3, NGHTTP2_NV_FLAG_NONE}};
  nghttp2_data_provider provider{};
  provider.source.ptr = body;
  provider.read_callback = read_body;
  nghttp2_submit_response(session, frame->hd.stream_id, headers, 1, &provider);
  return 0;
}

int stream_close_cb(nghttp2_session* session, int32_t stream_id, uint32_t, void*) {
  delete static_cast<std::string*>(nghttp2_session_get_stream_user_data(session, stream_id));
  return 0;
}

void serve(int fd) {
  Connection c;
  c.fd = fd;
  nghttp2_session_callbacks* cbs;
  nghttp2_session_callbacks_new(&cbs);
  nghttp2_session_callbacks_set_send_callback(cbs, send_cb);
  nghttp2_session_callbacks_set_on_header_callback(cbs, header_cb);
  nghttp2_session_callbacks_set_on_frame_recv_callback(cbs, frame_recv_cb);
  nghttp2_session_callbacks_set_on_stream_close_callback(cbs, stream_close_cb);
  nghttp2_session_server_new(&c.session, cbs, &c);
  nghttp2_session_callbacks_del(cbs);
  nghttp2_settings_entry settings[] = {{NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, 100},
                                       {NGHTTP2_SETTINGS_ENABLE_CONNECT_PROTOCOL, 1}};
  nghttp2_submit_settings(c.session, NGHTTP2_FLAG_NONE, settings, extended_connect ? 2 : 1);
  nghttp2_session_send(c.session);
  uint8_t buf[16384];
  for (;;) {
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    if (nghttp2_session_mem_recv(c.session, buf, static_cast<size_t>(n)) < 0) break;
    if (nghttp2_session_send(c.session) != 0) break;
    if (!nghttp2_session_want_read(c.session) && !nghttp2_session_want_write(c.session)) break;
  }
  nghttp2_session_del(c.session);
  ::close(fd);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3 || (argc == 3 && std::string_view(argv[2]) != "--extended-connect")) {
    fprintf(stderr, "usage: h2_recorder PORT [--extended-connect]\n");
    return 2;
  }
  extended_connect = argc == 3;
  int srv = ::socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  ::setsockopt(srv, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::atoi(argv[1])));
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  if (::bind(srv, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(srv, 64) != 0) {
    perror("h2_recorder: bind/listen");
    return 1;
  }
  for (;;) {
    int fd = ::accept(srv, nullptr, nullptr);
    if (fd >= 0) std::thread(serve, fd).detach();
  }
}
