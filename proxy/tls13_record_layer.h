// A TLS 1.3 connection's record protection after the handshake, done by the proxy itself, for when the kernel
// cannot take it (no kTLS). OpenSSL's SSL keeps about 13 KiB per connection for as long as it lives (its record
// layer arrays, the session, what the handshake left: bench/RESULTS.md), more than the 12 KiB an idle
// connection may cost in all. A connection quiet for a while hands its keys here and frees the SSL
// (TlsTransport::release_memory_while_idle); what stays is the two traffic secrets, keys and sequence numbers.
// The AEAD contexts and the record buffers exist only while bytes move, and go when the connection is quiet.
//
// What it does is what the kernel's TLS does (RFC 8446 section 5), with OpenSSL's AEADs: application data
// both ways; close_notify is the end of the stream, user_canceled is ignored, any other alert ends the
// connection; a client's KeyUpdate moves the receive key on (and, when it asks, ours with our own KeyUpdate
// before our next record), and so does our key after 2^23 records (AES-GCM's usage limit is 2^24.5); padding
// is stripped; anything else is an error. The sequence numbers it starts from are what OpenSSL used
// (Tls13SecretTracker counts the records). Reads take what the socket holds, several records per read()
// (into 4 KiB, or 64 KiB once bytes come in bursts); writes seal up to four records per send().
#pragma once

#include <openssl/evp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "common/error.h"
#include "proxy/transport.h"

namespace sg {

class Tls13RecordLayer {
 public:
  struct Keys {
    uint16_t cipher_suite = 0;  // IANA id: 0x1301 AES-128-GCM, 0x1302 AES-256-GCM, 0x1303 ChaCha20-Poly1305
    const EVP_MD* digest = nullptr;  // the suite's hash (HKDF)
    std::span<const unsigned char> client_secret;  // the client's application traffic secret
    uint64_t client_seq = 0;                       // the sequence number of the next record it sends
    std::span<const unsigned char> server_secret;
    uint64_t server_seq = 0;
  };
  static Result<std::unique_ptr<Tls13RecordLayer>> create(const Keys& keys);
  ~Tls13RecordLayer();
  Tls13RecordLayer(const Tls13RecordLayer&) = delete;
  Tls13RecordLayer& operator=(const Tls13RecordLayer&) = delete;

  // The Transport calls for the client's socket `fd` (proxy/transport.h has their meaning). A write that the
  // socket takes only in part reports the bytes of the records it took whole; the caller writes the rest again,
  // beginning with the same bytes, and the sealed records still due go out first.
  IoResult read(int fd, std::span<char> into);
  IoResult write(int fd, std::span<const char> from);
  bool shutdown_write(int fd);
  bool has_buffered_input() const;
  void release_memory_while_idle();

  static constexpr size_t kMaxPlaintext = 16384;                     // 2^14 (RFC 8446 5.1)
  static constexpr size_t kMaxCiphertext = kMaxPlaintext + 256;      // 5.2
  static constexpr size_t kHeader = 5;
  static constexpr size_t kTag = 16;
  static constexpr size_t kRecordsPerWrite = 4;
  static constexpr uint64_t kKeyUpdateAfterRecords = uint64_t{1} << 23;
  static constexpr unsigned kMaxEmptyRecordsInARow = 32;  // empty data, alerts, KeyUpdates
  static constexpr unsigned kMaxWarningAlerts = 5;        // user_canceled

 private:
  // One direction's traffic secret, the key and IV derived from it, and the next record's sequence number.
  struct TrafficKey {
    unsigned char secret[EVP_MAX_MD_SIZE];
    unsigned char key[32];
    unsigned char iv[12];
    uint64_t seq = 0;
    EVP_CIPHER_CTX* ctx = nullptr;  // keyed; made on first use, freed while idle
    bool encrypt = false;
  };

  Tls13RecordLayer(const EVP_CIPHER* cipher, const EVP_MD* digest, size_t key_len, size_t secret_len)
      : cipher_(cipher), digest_(digest), key_len_(key_len), secret_len_(secret_len) {}
  Status set_secret(TrafficKey& k, std::span<const unsigned char> secret);
  // The next generation of k's secret (RFC 8446 7.2), its key and IV, sequence 0.
  Status update_key(TrafficKey& k);
  bool keyed(TrafficKey& k);
  void nonce(const TrafficKey& k, unsigned char out[12]) const;
  // Seals one record of `type` carrying `data` at `out` (room for kHeader + size + 1 + kTag). Returns its size.
  size_t seal(uint8_t type, const char* data, size_t size, unsigned char* out);
  // Seals what must go before application data (a KeyUpdate we owe) and as much of `from` as fits into
  // out_; returns the plaintext bytes sealed.
  size_t seal_batch(std::span<const char> from);
  // Sends the sealed bytes not yet sent: kOk once all went, kWouldBlock, or kError.
  IoResult flush(int fd);
  // A decrypted record of a type other than application data (`content`, padding gone).
  IoResult control_record(uint8_t type, const unsigned char* content, size_t size);
  void ensure_out(size_t bytes);
  void grow_in(size_t bytes);

  const EVP_CIPHER* cipher_;
  const EVP_MD* digest_;
  size_t key_len_;
  size_t secret_len_;
  TrafficKey read_;
  TrafficKey write_;
  unsigned empty_run_ = 0;
  unsigned warning_alerts_ = 0;
  bool owe_key_update_ = false;  // the client asked for one: ours goes before our next record
  bool closing_ = false;         // close_notify sealed

  // Received bytes: [in_begin_, in_end_) not yet decrypted; [plain_at_, plain_at_ + plain_len_) decrypted
  // application data the reader had no room for.
  std::unique_ptr<unsigned char[]> in_;
  size_t in_cap_ = 0;
  bool filled_in_ = false;  // the last read() filled the buffer: a burst, for which the large one is taken
  size_t in_begin_ = 0;
  size_t in_end_ = 0;
  size_t plain_at_ = 0;
  size_t plain_len_ = 0;
  // Sealed records: [out_sent_, out_len_) not sent yet, carrying out_plain_ bytes of the caller's.
  std::unique_ptr<unsigned char[]> out_;
  size_t out_cap_ = 0;
  size_t out_len_ = 0;
  size_t out_sent_ = 0;
  size_t out_plain_ = 0;

 public:
  static constexpr size_t kInFirst = 4 * 1024;
  static constexpr size_t kInCapacity = 64 * 1024;
  static constexpr size_t kKeyUpdateRecord = kHeader + 5 + 1 + kTag;
};

}  // namespace sg
