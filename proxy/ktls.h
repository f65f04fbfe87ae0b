// Kernel TLS (kTLS) support beyond what OpenSSL 3.0 does by itself.
//
// OpenSSL 3.0 (SSL_OP_ENABLE_KTLS) hands the transmit side to the kernel for TLS 1.2 and 1.3 and the
// receive side for TLS 1.2. It declines TLS 1.3 receive, so we install that key ourselves, right after the
// handshake: the client application traffic secret comes from the keylog callback, the key and IV are
// derived from it with HKDF-Expand-Label (RFC 8446 7.3), and the record sequence number is the count of
// records OpenSSL read under that key (the msg callback counts them; none, when the switch comes at once).
// From then on the connection reads the socket itself (recvmsg, with each record's type) and frees its
// SSL (proxy/transport.h, KernelTlsTransport).
//
// Why the switch is safe: read_ahead stays off, so OpenSSL reads the socket one record at a time and never
// past a record boundary. Once SSL_has_pending() is false, every byte OpenSSL took from the socket has been
// decrypted and handed to us, and the socket's next byte starts the record with the counted sequence
// number.
#pragma once

#include <linux/tls.h>
#include <openssl/ssl.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <cstdint>
#include <span>
#include <string_view>

#include "common/error.h"

namespace sg {

// The kernel's receive parameters for a TLS 1.3 cipher suite (by IANA id, e.g. 0x1301), derived from a
// traffic secret; `seq` is the sequence number of the next record. Separate from install_tls13_rx so a
// unit test can check the derivation by decrypting a real record with it.
struct KernelTlsKey {
  union {
    tls12_crypto_info_aes_gcm_128 aes_gcm_128;
    tls12_crypto_info_aes_gcm_256 aes_gcm_256;
    tls12_crypto_info_chacha20_poly1305 chacha20_poly1305;
  } info;
  socklen_t size = 0;
  ~KernelTlsKey();  // wipes the key
};
Result<void> derive_tls13_kernel_key(uint16_t cipher_suite, const EVP_MD* digest,
                                     std::span<const unsigned char> traffic_secret, uint64_t seq,
                                     KernelTlsKey* out);

// What OpenSSL's callbacks saw of one connection's receive side; attached to its SSL with ex_data.
class KtlsRxTracker {
 public:
  KtlsRxTracker() = default;
  ~KtlsRxTracker();  // wipes the secret
  KtlsRxTracker(const KtlsRxTracker&) = delete;
  KtlsRxTracker& operator=(const KtlsRxTracker&) = delete;

  void attach(SSL* ssl);
  // Called when SSL_do_handshake returns 1: records read from now on are under the application key.
  void handshake_finished();
  // Installs the TLS 1.3 receive key on `fd` (which must already carry the "tls" ULP, as it does once
  // OpenSSL offloaded transmit). Fails, leaving the socket untouched, when OpenSSL still buffers input,
  // when the key changed after the handshake (KeyUpdate) or the cipher has no kernel implementation.
  Status install_tls13_rx(SSL* ssl, int fd);
  // The key install_tls13_rx gives the kernel, for the next record the socket will deliver.
  Status derive_rx_key(SSL* ssl, KernelTlsKey* out) const;

 private:
  friend void ktls_on_keylog(const SSL* ssl, const char* line);
  friend void ktls_on_message(int write_p, int version, int content_type, const void* buf, size_t len, SSL* ssl,
                              void* arg);

  unsigned char client_secret_[64] = {};  // CLIENT_TRAFFIC_SECRET_0 (32 or 48 bytes used)
  size_t client_secret_len_ = 0;
  uint64_t records_read_ = 0;
  uint64_t records_read_at_handshake_end_ = 0;
  bool handshake_done_ = false;
  // A record other than application data arrived after the handshake (KeyUpdate, an alert): the key or
  // the sequence OpenSSL reads with may have moved on, so the kernel is not given the old one.
  bool non_data_after_handshake_ = false;
};

// Installs the keylog and msg callbacks that feed KtlsRxTracker. Only for contexts that may offload: the
// callbacks run for every record, and the keylog callback sees secrets (they never leave the tracker).
void enable_ktls_rx_tracking(SSL_CTX* ctx);

// Reads from a kTLS receive socket with recvmsg: application data (one record or more), or one record of
// another type, with the TLS content type (the cmsg TLS_GET_RECORD_TYPE).
// Returns the payload length, 0 at EOF, or -1 with errno.
ssize_t recv_tls_record(int fd, char* buf, size_t capacity, uint8_t* record_type);
// Sends one record of `record_type` through a kTLS transmit socket (TLS_SET_RECORD_TYPE): an alert, since
// application data needs no type. Returns what send returns.
ssize_t send_tls_record(int fd, uint8_t record_type, const void* payload, size_t size);

// Logs, once per process for each distinct reason, why a connection uses the userspace TLS path.
void log_ktls_fallback_once(std::string_view reason);

}  // namespace sg
