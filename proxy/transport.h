// The two ends of a forwarded connection as one small interface, after HAProxy's `struct xprt_ops`
// (rcv_buf/snd_buf/rcv_pipe/snd_pipe): the forwarder moves bytes from a source transport to a sink
// transport without knowing what they are, and splice is a capability a transport has or not.
//   TcpTransport  the sandbox's socket (TCP, a unix socket, vsock): read/write are recv/send, splice
//                 always works.
//   TlsTransport  the client's socket during the handshake, and after it when the kernel cannot do its TLS
//                 both ways: SSL_read/SSL_write. Transmit offloaded to the kernel alone (kTLS) means bytes
//                 can splice out into the socket. Without kTLS, a TLS 1.3 connection quiet for a while
//                 frees its SSL and protects its records itself (proxy/tls13_record_layer.h).
//   KernelTlsTransport  the client's socket once the kernel does its TLS both ways: the SSL is freed,
//                 reads are recvmsg (with each record's type), writes are send, and both directions splice.
#pragma once

#include <openssl/ssl.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "common/error.h"
#include "proxy/access_log.h"
#include "proxy/ktls.h"
#include "proxy/splice_pipe.h"

namespace sg {

// What one read, write or splice on a transport did.
struct IoResult {
  enum class Status {
    kOk,          // moved `bytes`; more may be moved at once
    kWouldBlock,  // moved `bytes` (perhaps 0), then the socket would block: poll says when to retry
    kEof,         // moved `bytes`, then the peer finished sending
    kError,       // failed (`detail` says how); `bytes` moved before the failure still count
    kNotData,     // kTLS splice stopped at a record that is not application data: read() takes it
  };
  Status status = Status::kOk;
  size_t bytes = 0;
  std::string detail;
  // Set when the transport knows why the connection must end (a TLS alert, a KeyUpdate kTLS cannot follow);
  // unset: an I/O failure of that side.
  std::optional<TerminationCause> cause;
  bool waits_for_writable = false;  // kWouldBlock: retry when writable, not when readable
  // kOk from a read that took all the socket had (a short read): reading again now would only fail with
  // EAGAIN, so the reader waits for poll() (level-triggered: bytes that came meanwhile are reported). Saves
  // that failed read() per burst on each side: two of the six system calls of a small keep-alive request.
  bool drained = false;

  static IoResult ok(size_t n) { return {Status::kOk, n, {}, {}}; }
  static IoResult ok_drained(size_t n) {
    IoResult r{Status::kOk, n, {}, {}};
    r.drained = true;
    return r;
  }
  static IoResult would_block(size_t n = 0) { return {Status::kWouldBlock, n, {}, {}}; }
  // Would block until the socket is writable (a TLS read that must send first): readability says nothing.
  static IoResult would_block_on_write(size_t n = 0) {
    IoResult r{Status::kWouldBlock, n, {}, {}};
    r.waits_for_writable = true;
    return r;
  }
  static IoResult eof(size_t n = 0) { return {Status::kEof, n, {}, {}}; }
  static IoResult error(std::string detail, std::optional<TerminationCause> cause = std::nullopt) {
    return {Status::kError, 0, std::move(detail), cause};
  }
};

// What a socket call that moved nothing means: 0 is EOF, -1 would-block (retry when polled) or an error
// that says how (errno).
IoResult errno_result(ssize_t n);

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int fd() const = 0;
  virtual IoResult read(std::span<char> into) = 0;
  virtual IoResult write(std::span<const char> from) = 0;
  // Tells the peer this side sends no more (TLS: close_notify, then FIN). False: retry once writable.
  virtual bool shutdown_write() = 0;
  // Input taken from the socket but not yet returned by read (TLS records inside OpenSSL): poll() never
  // reports it, so whoever stops reading with some must come back without waiting for the socket.
  virtual bool has_buffered_input() const { return false; }

  // Splice, a capability a transport has for its whole life or never. out: pipe -> socket; in: socket ->
  // pipe. After splice_in returned kNotData (a kTLS record that is not application data), read() takes
  // that record.
  virtual bool can_splice_out() const { return false; }
  virtual bool can_splice_in() const { return false; }
  // At most `max` bytes.
  IoResult splice_in(SplicePipe& pipe, uint64_t max = UINT64_MAX);
  // Whether splice_in moving nothing means the peer finished. Not on a kTLS socket, where an empty
  // application-data record also splices as 0 (Linux's tls_sw_splice_read consumes it and returns 0): there
  // splice_in says kNotData, and read(), which steps over empty records, tells EOF from nothing yet.
  virtual bool spliced_zero_is_eof() const { return true; }
  IoResult splice_out(SplicePipe& pipe);
  // The connection has been quiet for a while: memory kept for the next bytes (TLS record buffers) goes
  // back, unless bytes are in it.
  virtual void release_memory_while_idle() {}
};

class TcpTransport : public Transport {
 public:
  explicit TcpTransport(int fd) : fd_(fd) {}
  int fd() const override { return fd_; }
  IoResult read(std::span<char> into) override;
  IoResult write(std::span<const char> from) override;
  bool shutdown_write() override;
  bool can_splice_out() const override { return true; }
  bool can_splice_in() const override { return true; }

 protected:
  int fd_;  // owned by the connection
};

class TlsTransport final : public Transport {
 public:
  // `ssl` is set up on `fd` and owned by this transport, and so is `tracker` (null: the record protection
  // stays with OpenSSL), which is attached to it here.
  // `may_leave_openssl`: the records may move to the proxy's own record layer (below).
  TlsTransport(SSL* ssl, int fd, std::unique_ptr<Tls13SecretTracker> tracker, bool may_leave_openssl = true);
  ~TlsTransport() override;
  TlsTransport(const TlsTransport&) = delete;
  TlsTransport& operator=(const TlsTransport&) = delete;

  // Null once the SSL is freed (after the handshake only).
  SSL* ssl() const { return ssl_; }
  // Called when SSL_do_handshake returned 1.
  void handshake_finished();
  int fd() const override { return fd_; }
  // SSL_read until `into` is full or the socket is dry (or, with read-ahead, OpenSSL's buffer is: then the
  // result is `drained`): SSL_read returns one record at a time, and the sandbox should get one large send
  // instead of one per record.
  IoResult read(std::span<char> into) override;
  IoResult write(std::span<const char> from) override;
  bool shutdown_write() override;
  bool has_buffered_input() const override;

  // After the handshake: whether OpenSSL handed transmit to the kernel (then bytes can splice out).
  void plan_ktls();
  bool ktls_tx() const { return ktls_tx_; }
  // Transmit is the kernel's, and now receive too: OpenSSL offloaded it itself (TLS 1.2), or the TLS 1.3 key is
  // installed here (proxy/ktls.h). Then OpenSSL has nothing left to do on this connection, and the caller
  // replaces this transport with a KernelTlsTransport. Must be called right after the handshake, before
  // any read: the socket is then at a record boundary. Fails, leaving receive to OpenSSL, with a reason
  // that names no connection (it is logged once per reason).
  Status hand_receive_to_kernel();
  // Before the transport is destroyed with its TLS going on in the kernel: OpenSSL drops the session of an
  // SSL freed before its connection shut down from the context's cache (its guard against a truncated
  // connection), and this connection has not ended. Keeps TLS 1.2 session-ID resumption working.
  void keep_session_when_freed() { SSL_set_shutdown(ssl_, SSL_SENT_SHUTDOWN | SSL_RECEIVED_SHUTDOWN); }
  bool can_splice_out() const override { return ktls_tx_; }
  // A TLS 1.3 connection without kTLS leaves OpenSSL altogether as soon as both sides are at a record
  // boundary: its keys go to a record layer of the proxy's own and the SSL is freed (13 KiB of an idle
  // connection's 18; and each record costs less there). With read-ahead that is the second read that emptied
  // OpenSSL's buffer (a connection that carries one request and closes never pays for the keys and AEAD
  // contexts) or a write after 64 KiB went out (a long answer to one request), else the first quiet spell.
  // Where it cannot be (TLS 1.2, a transmit side in the kernel, a KeyUpdate OpenSSL followed), a quiet
  // connection's SSL frees its record buffers: OpenSSL keeps them between records (no
  // SSL_MODE_RELEASE_BUFFERS, proxy/tls.cc), since freeing and taking 64 KiB + 16 KiB again per keep-alive
  // request cost more than the request's own work.
  void release_memory_while_idle() override;
  // Whether the record protection has left OpenSSL for the proxy's own record layer.
  bool own_records() const { return own_ != nullptr; }
  // After plan_ktls and the receive handover: the traffic secrets go (wiped) when no switch can use them.
  void forget_secrets_unless_needed();

 private:
  // Hands the record protection to the proxy's own record layer and frees the SSL, if it can be done now.
  bool leave_openssl();
  void forget_secrets();

  SSL* ssl_;
  int fd_;
  std::unique_ptr<Tls13SecretTracker> tracker_;
  std::unique_ptr<Tls13RecordLayer> own_;
  bool read_ahead_;  // set on the context when kTLS is not possible (proxy/tls.cc)
  // With read-ahead: the reads so far that left OpenSSL's buffer empty (record boundaries), up to 2.
  unsigned emptied_reads_ = 0;
  // Application bytes OpenSSL sent; past the bound a connection that read once leaves it at a write (a long
  // answer to one request), while a short answer to one request never pays for the switch.
  size_t written_by_openssl_ = 0;
  static constexpr size_t kLeaveOpenSslAfterBytesOut = 64 * 1024;
  bool may_leave_openssl_;
  bool ktls_tx_ = false;
  // OpenSSL holds part of a record it could not send: the next SSL_write must be the one that sends it.
  bool write_incomplete_ = false;
};

// The client's socket once the kernel does its TLS both ways. The handshake is over and OpenSSL has nothing
// left to do, so the connection frees its SSL (13 KiB of an idle connection's 18, bench/RESULTS.md) and
// keeps only this. The kernel says each record's type: application data is read, close_notify is EOF, and
// any other record but user_canceled ends the connection (kernel_tls_record_result); a client's KeyUpdate
// too, since this kernel cannot rekey (kKtlsKeyUpdate). TLS 1.3 tickets went out with the handshake.
// Otherwise a TCP socket: writes are plain sends (the kernel cuts them into records), and it splices both
// ways.
class KernelTlsTransport final : public TcpTransport {
 public:
  using TcpTransport::TcpTransport;
  IoResult read(std::span<char> into) override;
  // close_notify (an alert record the kernel encrypts), then FIN. False: retry once writable.
  bool shutdown_write() override;
  bool has_buffered_input() const override { return stash_len_ > 0; }
  bool spliced_zero_is_eof() const override { return false; }

 private:
  // The kernel hands over a record that is not application data only whole, so a reader with less room
  // than this (its buffer nearly full) reads into stash_, and the data beyond its room waits there. A
  // record's type cannot be peeked instead: a peek at an empty data record leaves it queued, and the
  // socket would stay readable with nothing to read.
  static constexpr size_t kControlRecordRoom = 64;
  char stash_[kControlRecordRoom];
  uint8_t stash_at_ = 0;
  uint8_t stash_len_ = 0;
};

// What `n` bytes the kernel delivered as one read, all of record type `type`, mean for the reader:
// application data is read; a close_notify alert is EOF; user_canceled waits for the close_notify that
// follows it; another alert ends the connection as the client's doing (kClientClosed, the alert named); a
// KeyUpdate ends it with kKtlsKeyUpdate; anything else is an error.
IoResult kernel_tls_record_result(uint8_t type, const char* data, size_t n);

}  // namespace sg
