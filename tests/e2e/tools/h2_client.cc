// An HTTP/2 client for the end-to-end tests that does what a browser's connection coalescing does: several
// requests, each with an :authority of its own, on ONE TLS connection (ALPN h2), one after the other.
//   h2_client CONNECT_ADDR PORT SNI CA_FILE REQUEST...
// REQUEST is "<authority>|<path>[|<name>: <value>]..."; for each, in order, the output has
// "--- stream <id> status <code>" and then the response body. A field named :method or :protocol replaces
// the default GET / adds the pseudo-header: "|:method: CONNECT|:protocol: websocket" is an extended CONNECT
// (RFC 8441), whose stream the client keeps open as a WebSocket client does (no END_STREAM); it is done once
// the response has ended.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <nghttp2/nghttp2.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

namespace {

struct Stream {
  std::string status = "none";
  std::string body;
  bool closed = false;
  bool response_ended = false;  // END_STREAM from the server
};

struct Client {
  SSL* ssl = nullptr;
  std::map<int32_t, Stream> streams;
};

ssize_t send_cb(nghttp2_session*, const uint8_t* data, size_t len, int, void* user) {
  int n = SSL_write(static_cast<Client*>(user)->ssl, data, static_cast<int>(len));
  return n <= 0 ? static_cast<ssize_t>(NGHTTP2_ERR_CALLBACK_FAILURE) : n;
}

int header_cb(nghttp2_session*, const nghttp2_frame* frame, const uint8_t* name, size_t namelen, const uint8_t* value,
              size_t valuelen, uint8_t, void* user) {
  if (std::string(reinterpret_cast<const char*>(name), namelen) == ":status")
    static_cast<Client*>(user)->streams[frame->hd.stream_id].status.assign(reinterpret_cast<const char*>(value), valuelen);
  return 0;
}

int data_cb(nghttp2_session*, uint8_t, int32_t stream_id, const uint8_t* data, size_t len, void* user) {
  static_cast<Client*>(user)->streams[stream_id].body.append(reinterpret_cast<const char*>(data), len);
  return 0;
}

int frame_recv_cb(nghttp2_session*, const nghttp2_frame* frame, void* user) {
  if ((frame->hd.type == NGHTTP2_HEADERS || frame->hd.type == NGHTTP2_DATA) && (frame->hd.flags & NGHTTP2_FLAG_END_STREAM))
    static_cast<Client*>(user)->streams[frame->hd.stream_id].response_ended = true;
  return 0;
}

// The body of a CONNECT stream: nothing yet, so HEADERS goes without END_STREAM and the stream stays open.
ssize_t no_body_yet(nghttp2_session*, int32_t, uint8_t*, size_t, uint32_t*, nghttp2_data_source*, void*) {
  return NGHTTP2_ERR_DEFERRED;
}

int close_cb(nghttp2_session*, int32_t stream_id, uint32_t, void* user) {
  static_cast<Client*>(user)->streams[stream_id].closed = true;
  return 0;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t at = s.find(sep, start);
    out.push_back(s.substr(start, at - start));
    if (at == std::string::npos) return out;
    start = at + 1;
  }
}

nghttp2_nv field(const std::string& name, const std::string& value) {
  return {(uint8_t*)name.data(), (uint8_t*)value.data(), name.size(), value.size(), NGHTTP2_NV_FLAG_NONE};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    fprintf(stderr, "usage: h2_client CONNECT_ADDR PORT SNI CA_FILE REQUEST...\n");
    return 2;
  }
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::atoi(argv[2])));
  inet_pton(AF_INET, argv[1], &addr.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    perror("connect");
    return 1;
  }
  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  SSL_CTX_load_verify_locations(ctx, argv[4], nullptr);
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);
  static const unsigned char kAlpn[] = "\x02h2";
  SSL_CTX_set_alpn_protos(ctx, kAlpn, sizeof kAlpn - 1);
  Client client;
  client.ssl = SSL_new(ctx);
  SSL_set_tlsext_host_name(client.ssl, argv[3]);
  SSL_set1_host(client.ssl, argv[3]);
  SSL_set_fd(client.ssl, fd);
  if (SSL_connect(client.ssl) != 1) {
    ERR_print_errors_fp(stderr);
    return 1;
  }
  const unsigned char* alpn = nullptr;
  unsigned alpn_len = 0;
  SSL_get0_alpn_selected(client.ssl, &alpn, &alpn_len);
  if (alpn_len != 2) {
    fprintf(stderr, "the server did not select h2\n");
    return 1;
  }
  nghttp2_session_callbacks* cbs;
  nghttp2_session_callbacks_new(&cbs);
  nghttp2_session_callbacks_set_send_callback(cbs, send_cb);
  nghttp2_session_callbacks_set_on_header_callback(cbs, header_cb);
  nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, data_cb);
  nghttp2_session_callbacks_set_on_stream_close_callback(cbs, close_cb);
  nghttp2_session_callbacks_set_on_frame_recv_callback(cbs, frame_recv_cb);
  nghttp2_session* session;
  nghttp2_session_client_new(&session, cbs, &client);
  nghttp2_session_callbacks_del(cbs);
  nghttp2_submit_settings(session, NGHTTP2_FLAG_NONE, nullptr, 0);
  int status = 0;
  for (int i = 5; i < argc; ++i) {
    std::vector<std::string> parts = split(argv[i], '|');
    std::vector<std::string> names = {":method", ":scheme", ":authority", ":path"};
    std::vector<std::string> values = {"GET", "https", parts[0], parts.size() > 1 ? parts[1] : "/"};
    for (size_t p = 2; p < parts.size(); ++p) {
      size_t colon = parts[p].find(':', parts[p][0] == ':' ? 1 : 0);
      std::string name = parts[p].substr(0, colon);
      std::string value = parts[p].substr(colon + 2);
      if (name == ":method") {
        values[0] = value;
      } else if (name == ":protocol") {
        names.insert(names.begin() + 4, name);  // with the other pseudo-headers, before the regular fields
        values.insert(values.begin() + 4, value);
      } else {
        names.push_back(name);
        values.push_back(value);
      }
    }
    std::vector<nghttp2_nv> nva;
    for (size_t f = 0; f < names.size(); ++f) nva.push_back(field(names[f], values[f]));
    const bool connect = values[0] == "CONNECT";
    nghttp2_data_provider open_stream{};
    open_stream.read_callback = no_body_yet;
    int32_t id = nghttp2_submit_request(session, nullptr, nva.data(), nva.size(), connect ? &open_stream : nullptr, nullptr);
    if (id < 0) {
      fprintf(stderr, "cannot submit request %d: %s\n", i - 4, nghttp2_strerror(id));
      return 1;
    }
    if (nghttp2_session_send(session) != 0) return 1;
    // One request at a time, so the sandbox sees them in order and each answer is known before the next.
    while (!client.streams[id].closed && !client.streams[id].response_ended) {
      uint8_t buf[16384];
      int n = SSL_read(client.ssl, buf, sizeof buf);
      if (n <= 0) {
        fprintf(stderr, "connection ended before stream %d was answered\n", id);
        status = 1;
        break;
      }
      if (nghttp2_session_mem_recv(session, buf, static_cast<size_t>(n)) < 0) return 1;
      if (nghttp2_session_send(session) != 0) return 1;
    }
    printf("--- stream %d status %s\n%s", id, client.streams[id].status.c_str(), client.streams[id].body.c_str());
    if (status != 0) break;
  }
  fflush(stdout);
  nghttp2_session_del(session);
  SSL_free(client.ssl);
  SSL_CTX_free(ctx);
  ::close(fd);
  return status;
}
