#include "proxy/transport.h"

#include <openssl/err.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/log.h"
#include "proxy/tls.h"
#include "proxy/tls13_record_layer.h"

namespace sg {
IoResult errno_result(ssize_t n) {
  if (n == 0) return IoResult::eof();
  if (errno == EAGAIN || errno == EINTR) return IoResult::would_block();
  return IoResult::error(std::strerror(errno));
}

namespace {

// The peer left without close_notify (or the socket was reset to silence) counts as finishing, as before
// kTLS: browsers routinely close without one.
bool ssl_finished(int err) { return err == SSL_ERROR_ZERO_RETURN || (err == SSL_ERROR_SYSCALL && ERR_peek_error() == 0); }

}  // namespace

IoResult Transport::splice_in(SplicePipe& pipe, uint64_t max) {
  ssize_t n = pipe.fill(fd(), max);
  if (n > 0) return IoResult::ok(static_cast<size_t>(n));
  // kTLS: the next record is not application data (an alert, a post-handshake message); splice cannot
  // carry it.
  if (n < 0 && errno == EINVAL) return {IoResult::Status::kNotData, 0, {}, {}};
  if (n == 0 && !spliced_zero_is_eof()) return {IoResult::Status::kNotData, 0, {}, {}};
  return errno_result(n);
}

IoResult Transport::splice_out(SplicePipe& pipe) {
  // kTLS: the kernel cuts the spliced bytes into TLS records as it sends them.
  ssize_t n = pipe.drain(fd());
  if (n >= 0) return IoResult::ok(static_cast<size_t>(n));
  return errno_result(n);
}

IoResult TcpTransport::read(std::span<char> into) {
  ssize_t n = ::recv(fd_, into.data(), into.size(), 0);
  if (n > 0) {
    // A stream socket's recv returns less than asked only when it took everything queued.
    return static_cast<size_t>(n) < into.size() ? IoResult::ok_drained(static_cast<size_t>(n))
                                                : IoResult::ok(static_cast<size_t>(n));
  }
  return errno_result(n);
}

IoResult TcpTransport::write(std::span<const char> from) {
  ssize_t n = ::send(fd_, from.data(), from.size(), MSG_NOSIGNAL);
  if (n >= 0) return IoResult::ok(static_cast<size_t>(n));
  return errno_result(-1);
}

bool TcpTransport::shutdown_write() {
  ::shutdown(fd_, SHUT_WR);
  return true;
}

TlsTransport::TlsTransport(SSL* ssl, int fd, std::unique_ptr<Tls13SecretTracker> tracker, bool may_leave_openssl)
    : ssl_(ssl),
      fd_(fd),
      tracker_(std::move(tracker)),
      read_ahead_(SSL_get_read_ahead(ssl) != 0),
      may_leave_openssl_(may_leave_openssl) {
  if (tracker_) tracker_->attach(ssl_);
}

TlsTransport::~TlsTransport() { SSL_free(ssl_); }

void TlsTransport::handshake_finished() {
  if (tracker_) tracker_->handshake_finished();
}

bool TlsTransport::has_buffered_input() const {
  return own_ ? own_->has_buffered_input() : SSL_has_pending(ssl_) == 1;
}

void TlsTransport::release_memory_while_idle() {
  if (own_) return own_->release_memory_while_idle();
  if (!leave_openssl()) SSL_free_buffers(ssl_);
}

void TlsTransport::forget_secrets() {
  if (!tracker_) return;
  tracker_->detach(ssl_);
  tracker_.reset();  // wipes them
}

void TlsTransport::forget_secrets_unless_needed() {
  if (!may_leave_openssl_ || ktls_tx_) forget_secrets();
}

bool TlsTransport::leave_openssl() {
  if (!may_leave_openssl_ || !tracker_ || ktls_tx_ || write_incomplete_) return false;
  auto layer = tracker_->take_record_layer(ssl_);
  if (!layer && layer.error() == Error::kConflict) return false;  // at a later record boundary
  // Its secrets are wiped: whatever kept the keys in OpenSSL (TLS 1.2, a KeyUpdate) keeps them there.
  forget_secrets();
  if (!layer) return false;
  own_ = std::move(*layer);
  // A TLS 1.3 session lives in its tickets; marked shut down so OpenSSL keeps any session it cached.
  SSL_set_shutdown(ssl_, SSL_SENT_SHUTDOWN | SSL_RECEIVED_SHUTDOWN);
  SSL_free(ssl_);
  ssl_ = nullptr;
  return true;
}

IoResult TlsTransport::read(std::span<char> into) {
  if (own_) return own_->read(fd_, into);
  int n = 0;
  size_t got = 0;
  while (got < into.size()) {
    clear_stale_ssl_errors();
    n = SSL_read(ssl_, into.data() + got, static_cast<int>(into.size() - got));
    if (n <= 0) break;
    got += static_cast<size_t>(n);
    // With read-ahead, OpenSSL's last read() asked for a whole buffer (64 KiB): once what it brought in is
    // all decrypted and handed over, the socket most likely holds nothing (and if it does, poll says so),
    // so the next SSL_read's read() would fail with EAGAIN. Without read-ahead it reads record by record,
    // and an empty OpenSSL buffer says nothing about the socket.
    if (got < into.size() && read_ahead_ && SSL_has_pending(ssl_) == 0) {
      // A record boundary on the receive side. The record protection leaves OpenSSL at the second (it costs
      // less per record on the proxy's own layer), not the first: a connection that carries one request and
      // closes would pay for deriving keys and making AEAD contexts it never uses (RESULTS.md).
      if (emptied_reads_ < 2) ++emptied_reads_;
      if (emptied_reads_ == 2) leave_openssl();
      return IoResult::ok_drained(got);
    }
  }
  if (n > 0) return IoResult::ok(got);  // stopped for room; an EOF or error behind the data comes next time
  int err = SSL_get_error(ssl_, n);
  if (err == SSL_ERROR_WANT_READ) return IoResult::would_block(got);
  if (err == SSL_ERROR_WANT_WRITE) return IoResult::would_block_on_write(got);
  if (ssl_finished(err)) return IoResult::eof(got);
  IoResult failed = IoResult::error(take_ssl_error());
  failed.bytes = got;
  return failed;
}

IoResult TlsTransport::write(std::span<const char> from) {
  // A long answer to one request (a download, a stream of events) brings no second read: past
  // kLeaveOpenSslAfterBytesOut the switch is tried here, between records.
  if (!own_ && read_ahead_ && emptied_reads_ < 2 && written_by_openssl_ >= kLeaveOpenSslAfterBytesOut)
    leave_openssl();
  if (own_) return own_->write(fd_, from);
  clear_stale_ssl_errors();
  int n = SSL_write(ssl_, from.data(), static_cast<int>(from.size()));
  write_incomplete_ = false;
  if (n > 0) {
    written_by_openssl_ += static_cast<size_t>(n);
    return IoResult::ok(static_cast<size_t>(n));
  }
  int err = SSL_get_error(ssl_, n);
  write_incomplete_ = true;
  if (err == SSL_ERROR_WANT_WRITE || err == SSL_ERROR_WANT_READ) return IoResult::would_block();
  return IoResult::error(err == SSL_ERROR_SYSCALL ? std::strerror(errno) : take_ssl_error());
}

bool TlsTransport::shutdown_write() {
  if (own_) return own_->shutdown_write(fd_);
  forget_secrets();  // no switch after close_notify
  clear_stale_ssl_errors();
  int r = SSL_shutdown(ssl_);
  if (r < 0) {
    int err = SSL_get_error(ssl_, r);
    if (err == SSL_ERROR_WANT_WRITE || err == SSL_ERROR_WANT_READ) return false;
  }
  ::shutdown(fd_, SHUT_WR);
  return true;
}

void TlsTransport::plan_ktls() { ktls_tx_ = BIO_get_ktls_send(SSL_get_wbio(ssl_)); }

Status TlsTransport::hand_receive_to_kernel() {
  if (!ktls_tx_)
    return fail(Error::kUnsupported, fmt::format("OpenSSL did not offload transmit for {} {}: cipher not offloadable",
                                                 SSL_get_version(ssl_), SSL_get_cipher_name(ssl_)));
  // Without read-ahead OpenSSL reads the socket one record at a time, so after the handshake it holds
  // nothing and the socket's next byte starts a record.
  if (SSL_has_pending(ssl_)) return fail(Error::kConflict, "OpenSSL still holds received bytes");
  if (BIO_get_ktls_recv(SSL_get_rbio(ssl_))) return {};  // TLS 1.2: OpenSSL offloaded it
  if (tracker_ == nullptr || SSL_version(ssl_) != TLS1_3_VERSION)
    return fail(Error::kUnsupported, fmt::format("OpenSSL did not offload receive for {} {}", SSL_get_version(ssl_),
                                                 SSL_get_cipher_name(ssl_)));
  if (auto st = tracker_->install_tls13_rx(ssl_, fd_); !st)
    return fail(st.error(), "TLS 1.3 receive not handed to the kernel: " + st.message());
  return {};
}

IoResult kernel_tls_record_result(uint8_t type, const char* data, size_t n) {
  const auto* record = reinterpret_cast<const unsigned char*>(data);
  switch (type) {
    case SSL3_RT_APPLICATION_DATA:
      return IoResult::ok(n);
    case SSL3_RT_ALERT:
      if (n < 2) return IoResult::error("a truncated TLS alert from the client");
      if (record[1] == SSL_AD_CLOSE_NOTIFY) return IoResult::eof();
      if (record[1] == SSL_AD_USER_CANCELLED) return IoResult::would_block();  // a close_notify follows
      return IoResult::error(std::string("TLS alert from the client: ") + SSL_alert_desc_string_long(record[1]),
                             TerminationCause::kClientClosed);
    case SSL3_RT_HANDSHAKE:
      if (n >= 1 && record[0] == SSL3_MT_KEY_UPDATE)
        return IoResult::error("the client sent a TLS 1.3 KeyUpdate; this kernel cannot rekey kTLS",
                               TerminationCause::kKtlsKeyUpdate);
      return IoResult::error(fmt::format("unexpected TLS handshake message {} after the handshake", n >= 1 ? record[0] : 0));
    default:
      return IoResult::error(fmt::format("unexpected TLS record type {}", type));
  }
}

IoResult KernelTlsTransport::read(std::span<char> into) {
  if (stash_len_ > 0) {
    const size_t n = std::min<size_t>(stash_len_, into.size());
    std::memcpy(into.data(), stash_ + stash_at_, n);
    stash_at_ += n;
    stash_len_ -= n;
    return IoResult::ok(n);  // the socket may hold more: not drained
  }
  const bool small = into.size() < kControlRecordRoom;
  char* dest = small ? stash_ : into.data();
  const size_t room = small ? sizeof stash_ : into.size();
  uint8_t type = SSL3_RT_APPLICATION_DATA;
  ssize_t n = recv_tls_record(fd_, dest, room, &type);
  if (n <= 0) {
    IoResult r = errno_result(n);
    if (r.status == IoResult::Status::kError) r.detail = "kTLS receive: " + r.detail;
    return r;
  }
  IoResult r = kernel_tls_record_result(type, dest, static_cast<size_t>(n));
  if (r.status != IoResult::Status::kOk) return r;
  if (small) {
    r.bytes = std::min(r.bytes, into.size());
    std::memcpy(into.data(), stash_, r.bytes);
    stash_at_ = static_cast<uint8_t>(r.bytes);
    stash_len_ = static_cast<uint8_t>(static_cast<size_t>(n) - r.bytes);
  }
  // The kernel returns fewer bytes than asked only when no whole record is left (poll says when the next
  // one is in) or the next one is of another type (then poll says readable at once).
  if (static_cast<size_t>(n) < room && stash_len_ == 0) r.drained = true;
  return r;
}

bool KernelTlsTransport::shutdown_write() {
  const unsigned char close_notify[2] = {SSL3_AL_WARNING, SSL_AD_CLOSE_NOTIFY};
  if (send_tls_record(fd_, SSL3_RT_ALERT, close_notify, sizeof close_notify) < 0 && (errno == EAGAIN || errno == EINTR))
    return false;
  ::shutdown(fd_, SHUT_WR);
  return true;
}

}  // namespace sg
