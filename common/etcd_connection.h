// One connection to one etcd member, plain (http://) or TLS (https://), for common/etcd_client.h: a call
// is one request on a connection of its own, a watch one long-lived stream.
//
// TLS is what a production etcd asks for: the member's certificate is verified against etcd_cacert (or the
// system's trust store) and its IP address (the member's URL is numeric) or etcd_server_name, and a client
// certificate is presented when etcd runs with --client-cert-auth. Each member's last session is kept and
// offered again, so a connection per request costs a resumed handshake, not a full one.
#pragma once

#include <openssl/ssl.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/fd.h"
#include "common/http_client.h"
#include "common/net.h"

namespace sg::etcd {

using Clock = std::chrono::steady_clock;

// Where one member listens, and whether it speaks TLS.
struct Member {
  Endpoint endpoint;  // numeric TCP address: nothing here resolves names
  bool tls = false;
  std::string to_string() const;  // "https://127.0.0.1:2379"
};

// "http://IP:PORT", "https://IP:PORT", or "IP:PORT" (http); a trailing "/" is allowed.
Result<Member> parse_member(std::string_view text);

// The [fleet] files for https:// members.
struct TlsFiles {
  std::string cacert;       // PEM CA file; "" = the system's trust store
  std::string cert;         // PEM client certificate (etcd --client-cert-auth), with `key`; "" = none
  std::string key;
  std::string server_name;  // the name the members' certificates carry; "" = their IP address
  bool any() const { return !cacert.empty() || !cert.empty() || !key.empty() || !server_name.empty(); }
};

// What every TLS connection of one client shares: the context (loaded once) and each member's last session.
class TlsSetup {
 public:
  // Loads the CA and the client certificate; a file that is missing or does not load, a key that does not
  // match its certificate, or only one of cert and key is kInvalidArgument naming the file.
  static Result<std::shared_ptr<TlsSetup>> create(const TlsFiles& files, size_t members);
  ~TlsSetup();
  TlsSetup(const TlsSetup&) = delete;
  TlsSetup& operator=(const TlsSetup&) = delete;

  SSL_CTX* context() const { return ctx_; }
  const std::string& server_name() const { return server_name_; }
  // The session to offer member `i` (a new reference, or nullptr).
  SSL_SESSION* session(size_t i) const;
  // Where a connection's SSL keeps its member's index (a size_t*), for on_new_session.
  static int connection_slot();
  // How many handshakes resumed a session (tests, logs).
  size_t resumed() const;
  void count_handshake(bool resumed);

 private:
  TlsSetup(SSL_CTX* ctx, std::string server_name, size_t members);
  static int on_new_session(SSL* ssl, SSL_SESSION* session);
  static int context_slot();
  SSL_CTX* ctx_;
  std::string server_name_;
  mutable std::mutex mu_;
  std::vector<SSL_SESSION*> sessions_;
  size_t resumed_ = 0;
};

class MemberConnection {
 public:
  // Connects to member `index` and, for TLS (`tls` set), completes a verified handshake, all by `deadline`.
  // kTimeout past it; kUnavailable when the member cannot be reached or its certificate does not verify
  // (the reason in the message).
  static Result<MemberConnection> open(const Member& member, size_t index, TlsSetup* tls, Clock::time_point deadline);
  MemberConnection(MemberConnection&&) = default;
  MemberConnection& operator=(MemberConnection&&) = default;

  int fd() const { return fd_.get(); }
  // For http_exchange: the connection's bytes, bounded by `deadline`.
  HttpByteStream stream(Clock::time_point deadline);

  // A read that never waits (a watch polls the socket together with its cancel pipe).
  struct ReadNow {
    size_t bytes = 0;
    bool ended = false;      // the member closed the stream
    short wait_events = 0;   // nothing yet: poll the fd for these (POLLIN, or POLLOUT during a TLS key update)
  };
  Result<ReadNow> read_now(char* buf, size_t cap);

 private:
  // A connection per call ends without close_notify: marked as shut down, so OpenSSL does not mark its
  // session (which may be the one other threads are resuming) unusable.
  struct SslFree {
    void operator()(SSL* s) const {
      SSL_set_shutdown(s, SSL_SENT_SHUTDOWN | SSL_RECEIVED_SHUTDOWN);
      SSL_free(s);
    }
  };
  MemberConnection(UniqueFd fd, std::unique_ptr<SSL, SslFree> ssl, std::unique_ptr<size_t> member_index)
      : fd_(std::move(fd)), member_index_(std::move(member_index)), ssl_(std::move(ssl)) {}
  Status write_all(std::string_view data, Clock::time_point deadline);
  Result<size_t> read_some(char* buf, size_t cap, Clock::time_point deadline);

  UniqueFd fd_;
  std::unique_ptr<size_t> member_index_;  // what ssl_'s connection_slot points to: declared first, freed last
  std::unique_ptr<SSL, SslFree> ssl_;     // null: plain
};

}  // namespace sg::etcd
