// Kernel TLS (kTLS) support beyond what OpenSSL 3.0 does by itself.
//
// OpenSSL 3.0 (SSL_OP_ENABLE_KTLS) hands the transmit side to the kernel for TLS 1.2 and 1.3 and the
// receive side for TLS 1.2. It declines TLS 1.3 receive, so we install that key ourselves, right after the
// handshake: the client application traffic secret comes from the keylog callback, the key and IV are
// derived from it with HKDF-Expand-Label (RFC 8446 7.3), and the record sequence number is the count of
// records OpenSSL read under that key (the msg callback counts them; none, when the switch comes at once).
// From then on the connection reads the socket itself (recvmsg, with each record's type) and frees its
// SSL (proxy/transport.h, KernelTlsTransport). Without kTLS, the same secrets and counts (both ways) let a
// quiet connection move to the proxy's own record layer instead (proxy/tls13_record_layer.h).
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
#include <initializer_list>
#include <memory>
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

// HKDF-Expand-Label(secret, label, "", length) of RFC 8446 section 7.1, for lengths up to the hash's (every
// key, IV and next secret TLS 1.3 derives from a traffic secret).
Status tls13_hkdf_expand_label(const EVP_MD* digest, std::span<const unsigned char> secret, std::string_view label,
                               unsigned char* out, size_t length);
// The same for several labels of one secret, keyed once.
struct Tls13Label {
  std::string_view label;
  unsigned char* out;
  size_t length;
};
Status tls13_hkdf_expand_labels(const EVP_MD* digest, std::span<const unsigned char> secret,
                                std::initializer_list<Tls13Label> labels);

class Tls13RecordLayer;

// What OpenSSL's callbacks saw of one connection's TLS 1.3 traffic secrets and records, so that its record
// protection can leave OpenSSL after the handshake: receive to the kernel (install_tls13_rx), or both ways to
// the proxy's own record layer once the connection is idle (take_record_layer, proxy/tls13_record_layer.h).
// Attached to the connection's SSL with ex_data.
class Tls13SecretTracker {
 public:
  Tls13SecretTracker() = default;
  ~Tls13SecretTracker();  // wipes the secrets
  Tls13SecretTracker(const Tls13SecretTracker&) = delete;
  Tls13SecretTracker& operator=(const Tls13SecretTracker&) = delete;

  void attach(SSL* ssl);
  void detach(SSL* ssl);
  // Called when SSL_do_handshake returns 1: records read from now on are under the application key.
  void handshake_finished();
  // Installs the TLS 1.3 receive key on `fd` (which must already carry the "tls" ULP, as it does once
  // OpenSSL offloaded transmit). Fails, leaving the socket untouched, when OpenSSL still buffers input,
  // when the key changed after the handshake (KeyUpdate) or the cipher has no kernel implementation.
  Status install_tls13_rx(SSL* ssl, int fd);
  // The key install_tls13_rx gives the kernel, for the next record the socket will deliver.
  Status derive_rx_key(SSL* ssl, KernelTlsKey* out) const;
  // Both directions' keys and sequence numbers as a record layer of the proxy's own, for an SSL that is
  // about to be freed; its last write must have been whole (the caller knows: OpenSSL does not say).
  // kConflict, with the secrets kept for a later try: not now (the handshake is not over, OpenSSL holds
  // received bytes or has read a record's header alone). Any other failure is for good (not TLS 1.3, a
  // suite the layer lacks, a secret not seen, a post-handshake message that moved the keys on); it and
  // success wipe the secrets.
  Result<std::unique_ptr<Tls13RecordLayer>> take_record_layer(SSL* ssl);

 private:
  // Whether the record protection can leave OpenSSL now (kConflict: not yet; another error: never).
  Status ready_to_leave_openssl(SSL* ssl) const;
  friend void ktls_on_keylog(const SSL* ssl, const char* line);
  friend void ktls_on_message(int write_p, int version, int content_type, const void* buf, size_t len, SSL* ssl,
                              void* arg);

  void wipe_secrets();

  unsigned char client_secret_[64] = {};  // CLIENT_TRAFFIC_SECRET_0 (32 or 48 bytes used)
  size_t client_secret_len_ = 0;
  unsigned char server_secret_[64] = {};  // SERVER_TRAFFIC_SECRET_0
  size_t server_secret_len_ = 0;
  uint64_t records_read_ = 0;
  uint64_t records_read_at_handshake_end_ = 0;
  // The server's application key protects every record written after its Finished (the session tickets
  // among them): the sequence number of the next one is the count since.
  uint64_t records_written_ = 0;
  uint64_t records_written_at_server_finished_ = 0;
  bool server_finished_written_ = false;
  // OpenSSL reported a record's header and not yet its decrypted content: it waits for the body, and the
  // socket's next byte is inside that record (SSL_has_pending does not count what was taken already).
  bool inside_read_record_ = false;
  bool handshake_done_ = false;
  // A record other than application data arrived after the handshake (KeyUpdate, an alert): the key or
  // the sequence OpenSSL reads with may have moved on, so the kernel is not given the old one.
  bool non_data_after_handshake_ = false;
};

// Installs the keylog and msg callbacks that feed Tls13SecretTracker: the callbacks run for every record, and
// the keylog callback sees secrets (they never leave the tracker but for the record layer it makes).
void enable_tls13_secret_tracking(SSL_CTX* ctx);

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
