#include "proxy/tls13_record_layer.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/ssl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/log.h"
#include "proxy/ktls.h"

namespace sg {
namespace {

constexpr uint8_t kApplicationData = SSL3_RT_APPLICATION_DATA;  // 23, also every protected record's outer type
constexpr uint8_t kAlert = SSL3_RT_ALERT;
constexpr uint8_t kHandshake = SSL3_RT_HANDSHAKE;

// Fetched once: an implicit fetch at every init would look the algorithm up again.
const EVP_CIPHER* aead_for(uint16_t suite, size_t* key_len) {
  static EVP_CIPHER* const aes128 = EVP_CIPHER_fetch(nullptr, "AES-128-GCM", nullptr);
  static EVP_CIPHER* const aes256 = EVP_CIPHER_fetch(nullptr, "AES-256-GCM", nullptr);
  static EVP_CIPHER* const chacha = EVP_CIPHER_fetch(nullptr, "ChaCha20-Poly1305", nullptr);
  switch (suite) {
    case 0x1301: *key_len = 16; return aes128;
    case 0x1302: *key_len = 32; return aes256;
    case 0x1303: *key_len = 32; return chacha;
    default: return nullptr;
  }
}

IoResult failed(size_t moved, std::string detail) {
  IoResult r = IoResult::error(std::move(detail));
  r.bytes = moved;
  return r;
}

}  // namespace

Result<std::unique_ptr<Tls13RecordLayer>> Tls13RecordLayer::create(const Keys& keys) {
  size_t key_len = 0;
  const EVP_CIPHER* cipher = aead_for(keys.cipher_suite, &key_len);
  if (!cipher) return fail(Error::kUnsupported, fmt::format("no record layer for cipher suite 0x{:04x}", keys.cipher_suite));
  if (!keys.digest) return fail(Error::kInternal, "no hash for the cipher suite");
  const size_t secret_len = static_cast<size_t>(EVP_MD_get_size(keys.digest));
  if (keys.client_secret.size() != secret_len || keys.server_secret.size() != secret_len)
    return fail(Error::kInvalidArgument, "a traffic secret's length is not the suite's hash length");
  std::unique_ptr<Tls13RecordLayer> layer(new Tls13RecordLayer(cipher, keys.digest, key_len, secret_len));
  layer->write_.encrypt = true;
  if (auto st = layer->set_secret(layer->read_, keys.client_secret); !st) return st.failure();
  if (auto st = layer->set_secret(layer->write_, keys.server_secret); !st) return st.failure();
  layer->read_.seq = keys.client_seq;
  layer->write_.seq = keys.server_seq;
  return layer;
}

Tls13RecordLayer::~Tls13RecordLayer() {
  EVP_CIPHER_CTX_free(read_.ctx);
  EVP_CIPHER_CTX_free(write_.ctx);
  OPENSSL_cleanse(&read_, sizeof read_);
  OPENSSL_cleanse(&write_, sizeof write_);
}

Status Tls13RecordLayer::set_secret(TrafficKey& k, std::span<const unsigned char> secret) {
  std::memcpy(k.secret, secret.data(), secret_len_);
  if (auto st = tls13_hkdf_expand_labels(digest_, std::span(k.secret, secret_len_),
                                         {{"key", k.key, key_len_}, {"iv", k.iv, sizeof k.iv}});
      !st)
    return st;
  k.seq = 0;
  if (k.ctx && EVP_CipherInit_ex2(k.ctx, nullptr, k.key, nullptr, k.encrypt ? 1 : 0, nullptr) != 1)
    return fail(Error::kInternal, "rekeying the AEAD failed");
  return {};
}

Status Tls13RecordLayer::update_key(TrafficKey& k) {
  unsigned char next[EVP_MAX_MD_SIZE];
  auto st = tls13_hkdf_expand_label(digest_, std::span(k.secret, secret_len_), "traffic upd", next, secret_len_);
  if (st) st = set_secret(k, std::span(next, secret_len_));
  OPENSSL_cleanse(next, sizeof next);
  return st;
}

bool Tls13RecordLayer::keyed(TrafficKey& k) {
  if (k.ctx) return true;
  k.ctx = EVP_CIPHER_CTX_new();
  if (k.ctx && EVP_CipherInit_ex2(k.ctx, cipher_, k.key, nullptr, k.encrypt ? 1 : 0, nullptr) == 1) return true;
  EVP_CIPHER_CTX_free(k.ctx);
  k.ctx = nullptr;
  return false;
}

void Tls13RecordLayer::nonce(const TrafficKey& k, unsigned char out[12]) const {
  std::memcpy(out, k.iv, 12);
  for (int i = 0; i < 8; ++i) out[11 - i] ^= static_cast<unsigned char>(k.seq >> (8 * i));
}

size_t Tls13RecordLayer::seal(uint8_t type, const char* data, size_t size, unsigned char* out) {
  const size_t body = size + 1 + kTag;
  out[0] = kApplicationData;
  out[1] = 0x03;
  out[2] = 0x03;
  out[3] = static_cast<unsigned char>(body >> 8);
  out[4] = static_cast<unsigned char>(body);
  unsigned char iv[12];
  nonce(write_, iv);
  int n = 0;
  unsigned char* text = out + kHeader;
  // The inner plaintext is the data, then its type (no padding). GCM and ChaCha20-Poly1305 are stream
  // ciphers: two updates seal it without copying the data next to its type first.
  bool ok = EVP_CipherInit_ex2(write_.ctx, nullptr, nullptr, iv, 1, nullptr) == 1 &&
            EVP_EncryptUpdate(write_.ctx, nullptr, &n, out, kHeader) == 1 &&
            (size == 0 || EVP_EncryptUpdate(write_.ctx, text, &n, reinterpret_cast<const unsigned char*>(data),
                                            static_cast<int>(size)) == 1) &&
            EVP_EncryptUpdate(write_.ctx, text + size, &n, &type, 1) == 1 &&
            EVP_EncryptFinal_ex(write_.ctx, text + size + 1, &n) == 1 &&
            EVP_CIPHER_CTX_ctrl(write_.ctx, EVP_CTRL_AEAD_GET_TAG, kTag, text + size + 1) == 1;
  ++write_.seq;  // used, even if sealing failed
  return ok ? kHeader + body : 0;
}

size_t Tls13RecordLayer::seal_batch(std::span<const char> from) {
  out_len_ = out_sent_ = out_plain_ = 0;
  const size_t records = std::min(kRecordsPerWrite, (from.size() + kMaxPlaintext - 1) / kMaxPlaintext);
  const size_t plain = std::min(from.size(), kRecordsPerWrite * kMaxPlaintext);
  ensure_out(kKeyUpdateRecord + plain + records * (kHeader + 1 + kTag));
  if (owe_key_update_ || write_.seq >= kKeyUpdateAfterRecords) {
    const char key_update[5] = {SSL3_MT_KEY_UPDATE, 0, 0, 1, SSL_KEY_UPDATE_NOT_REQUESTED};
    size_t n = seal(kHandshake, key_update, sizeof key_update, out_.get());
    if (n == 0 || !update_key(write_)) return SIZE_MAX;
    out_len_ = n;
    owe_key_update_ = false;
  }
  size_t sealed = 0;
  for (size_t records = 0; sealed < from.size() && records < kRecordsPerWrite; ++records) {
    const size_t size = std::min(kMaxPlaintext, from.size() - sealed);
    size_t n = seal(kApplicationData, from.data() + sealed, size, out_.get() + out_len_);
    if (n == 0) return SIZE_MAX;
    out_len_ += n;
    sealed += size;
  }
  out_plain_ = sealed;
  return sealed;
}

IoResult Tls13RecordLayer::flush(int fd) {
  while (out_sent_ < out_len_) {
    ssize_t n = ::send(fd, out_.get() + out_sent_, out_len_ - out_sent_, MSG_NOSIGNAL);
    if (n < 0) return errno_result(n);
    out_sent_ += static_cast<size_t>(n);
  }
  return IoResult::ok(0);
}

IoResult Tls13RecordLayer::write(int fd, std::span<const char> from) {
  size_t done = 0;
  if (out_sent_ < out_len_) {
    IoResult r = flush(fd);
    if (r.status != IoResult::Status::kOk) return r;
    done = out_plain_;
    if (done > from.size()) return IoResult::error("TLS write retried with fewer bytes than were sealed");
  }
  out_len_ = out_sent_ = out_plain_ = 0;
  if (done == from.size()) return IoResult::ok(done);
  if (closing_) return IoResult::error("TLS write after close_notify");
  if (!keyed(write_)) return IoResult::error("no AEAD context for the TLS write key");
  const size_t sealed = seal_batch(from.subspan(done));
  if (sealed == SIZE_MAX) return IoResult::error("sealing a TLS record failed");
  IoResult r = flush(fd);
  if (r.status == IoResult::Status::kError) return r;
  if (r.status == IoResult::Status::kOk) {
    out_len_ = out_sent_ = out_plain_ = 0;
    return IoResult::ok(done + sealed);
  }
  r.bytes = done;  // the rest is reported once its records are all out
  r.waits_for_writable = true;
  return r;
}

bool Tls13RecordLayer::shutdown_write(int fd) {
  if (!closing_) {
    // The caller shuts down once every byte it wrote was reported written; sealed records still due go first.
    if (flush(fd).status == IoResult::Status::kWouldBlock) return false;
    const char close_notify[2] = {SSL3_AL_WARNING, SSL_AD_CLOSE_NOTIFY};
    closing_ = true;
    out_sent_ = out_plain_ = 0;
    ensure_out(kHeader + sizeof close_notify + 1 + kTag);
    out_len_ = keyed(write_) ? seal(kAlert, close_notify, sizeof close_notify, out_.get()) : 0;
  }
  if (flush(fd).status == IoResult::Status::kWouldBlock) return false;
  ::shutdown(fd, SHUT_WR);
  return true;
}

void Tls13RecordLayer::ensure_out(size_t bytes) {
  if (out_cap_ >= bytes) return;
  out_ = std::make_unique_for_overwrite<unsigned char[]>(bytes);  // nothing is pending: nothing to keep
  out_cap_ = bytes;
}

// Grows the receive buffer to `bytes`, keeping what it holds (nothing is decrypted and waiting then).
void Tls13RecordLayer::grow_in(size_t bytes) {
  auto bigger = std::make_unique_for_overwrite<unsigned char[]>(bytes);
  if (in_end_ > in_begin_) std::memcpy(bigger.get(), in_.get() + in_begin_, in_end_ - in_begin_);
  in_end_ -= in_begin_;
  in_begin_ = 0;
  in_ = std::move(bigger);
  in_cap_ = bytes;
}

IoResult Tls13RecordLayer::control_record(uint8_t type, const unsigned char* content, size_t size) {
  if (type == kAlert) {
    IoResult r = kernel_tls_record_result(type, reinterpret_cast<const char*>(content), size);
    if (r.status == IoResult::Status::kWouldBlock && ++warning_alerts_ > kMaxWarningAlerts)
      return IoResult::error("too many TLS warning alerts");
    return r;
  }
  if (type != kHandshake) return IoResult::error(fmt::format("unexpected TLS record type {} after the handshake", type));
  // Only KeyUpdate may come from a client now; it ends its record (a key change is at a record boundary).
  if (size != 5 || content[0] != SSL3_MT_KEY_UPDATE || content[1] != 0 || content[2] != 0 || content[3] != 1 ||
      content[4] > SSL_KEY_UPDATE_REQUESTED)
    return IoResult::error(fmt::format("unexpected TLS handshake message {} after the handshake", content[0]));
  if (!update_key(read_)) return IoResult::error("deriving the client's next traffic key failed");
  if (content[4] == SSL_KEY_UPDATE_REQUESTED) owe_key_update_ = true;
  return IoResult::ok(0);
}

IoResult Tls13RecordLayer::read(int fd, std::span<char> into) {
  size_t got = 0;
  bool dry = false;
  while (got < into.size()) {
    if (plain_len_ > 0) {
      const size_t n = std::min(plain_len_, into.size() - got);
      std::memcpy(into.data() + got, in_.get() + plain_at_, n);
      plain_at_ += n;
      plain_len_ -= n;
      got += n;
      continue;
    }
    const size_t held = in_end_ - in_begin_;
    if (held >= kHeader) {
      unsigned char* header = in_.get() + in_begin_;
      const size_t len = size_t{header[3]} << 8 | header[4];
      if (header[0] != kApplicationData)
        return failed(got, fmt::format("unexpected TLS record type {} after the handshake", header[0]));
      if (len > kMaxCiphertext) return failed(got, "a TLS record longer than 2^14 + 256 bytes (record_overflow)");
      if (len < 1 + kTag) return failed(got, "a TLS record too short to hold its type and tag");
      // The inner plaintext (content, type, padding) is at most 2^14 + 1 bytes (RFC 8446 5.4).
      if (len - kTag > kMaxPlaintext + 1) return failed(got, "a TLS record's plaintext is longer than 2^14 + 1 bytes");
      if (held >= kHeader + len) {
        unsigned char* body = header + kHeader;
        in_begin_ += kHeader + len;
        const size_t text_len = len - kTag;
        // Decrypted straight into the reader's room when the record fits, else in place.
        const bool direct = into.size() - got >= text_len;
        unsigned char* text = direct ? reinterpret_cast<unsigned char*>(into.data() + got) : body;
        if (!keyed(read_)) return failed(got, "no AEAD context for the TLS read key");
        unsigned char iv[12];
        nonce(read_, iv);
        int n = 0;
        bool ok = EVP_CipherInit_ex2(read_.ctx, nullptr, nullptr, iv, 0, nullptr) == 1 &&
                  EVP_DecryptUpdate(read_.ctx, nullptr, &n, header, kHeader) == 1 &&
                  EVP_DecryptUpdate(read_.ctx, text, &n, body, static_cast<int>(text_len)) == 1 &&
                  EVP_CIPHER_CTX_ctrl(read_.ctx, EVP_CTRL_AEAD_SET_TAG, kTag, body + text_len) == 1 &&
                  EVP_DecryptFinal_ex(read_.ctx, text + text_len, &n) == 1;
        ++read_.seq;
        if (!ok) return failed(got, "a TLS record that does not authenticate (bad_record_mac)");
        size_t size = text_len;
        while (size > 0 && text[size - 1] == 0) --size;  // padding
        if (size == 0) return failed(got, "a TLS record with no content type");
        const uint8_t type = text[--size];
        // Records that carry nothing cost a decryption each (a KeyUpdate three HMACs more) and end no read:
        // a run of them is cut short, as OpenSSL and BoringSSL do (32 in a row; 5 warning alerts).
        if (type != kApplicationData || size == 0) {
          if (++empty_run_ > kMaxEmptyRecordsInARow)
            return failed(got, "too many TLS records in a row that carry no data");
        } else {
          empty_run_ = 0;
        }
        if (type == kApplicationData) {
          if (direct) {
            got += size;
          } else {
            plain_at_ = static_cast<size_t>(text - in_.get());
            plain_len_ = size;
          }
          continue;
        }
        IoResult r = control_record(type, text, size);
        if (r.status == IoResult::Status::kOk || r.status == IoResult::Status::kWouldBlock) continue;
        r.bytes = got;
        return r;
      }
    }
    if (dry) break;
    // A small buffer first (a request, a close_notify, the EOF of a connection that ends), the large one
    // once a record or a burst does not fit: thousands of connections closing at once each read here.
    const size_t record = held >= kHeader ? kHeader + (size_t{in_[in_begin_ + 3]} << 8 | in_[in_begin_ + 4]) : 0;
    if (in_cap_ < kInFirst) grow_in(kInFirst);
    if (in_cap_ < kInCapacity && (record > in_cap_ || filled_in_)) grow_in(kInCapacity);
    if (in_begin_ > 0) {
      std::memmove(in_.get(), in_.get() + in_begin_, held);
      in_begin_ = 0;
      in_end_ = held;
    }
    const size_t room = in_cap_ - in_end_;
    ssize_t n = ::read(fd, in_.get() + in_end_, room);
    if (n <= 0) {
      if (n == 0 && held > 0) return failed(got, "the connection ended inside a TLS record");
      IoResult r = errno_result(n);
      r.bytes = got;
      return r;
    }
    in_end_ += static_cast<size_t>(n);
    // A stream socket's read returns less than asked only when it took everything queued.
    dry = static_cast<size_t>(n) < room;
    filled_in_ = !dry;
  }
  if (got == into.size()) return IoResult::ok(got);
  return got > 0 ? IoResult::ok_drained(got) : IoResult::would_block();
}

bool Tls13RecordLayer::has_buffered_input() const {
  if (plain_len_ > 0) return true;
  const size_t held = in_end_ - in_begin_;
  if (held < kHeader) return false;
  const unsigned char* header = in_.get() + in_begin_;
  // A whole record, or one the reader must fail: either way it is for read(), not for poll().
  const size_t len = size_t{header[3]} << 8 | header[4];
  return held >= kHeader + len || header[0] != kApplicationData || len > kMaxCiphertext;
}

void Tls13RecordLayer::release_memory_while_idle() {
  if (in_end_ == in_begin_ && plain_len_ == 0) {
    in_.reset();
    in_cap_ = in_begin_ = in_end_ = 0;
    filled_in_ = false;
    EVP_CIPHER_CTX_free(read_.ctx);
    read_.ctx = nullptr;
  }
  if (out_sent_ == out_len_ && !closing_) {
    out_.reset();
    out_cap_ = out_len_ = out_sent_ = out_plain_ = 0;
    EVP_CIPHER_CTX_free(write_.ctx);
    write_.ctx = nullptr;
  }
}

}  // namespace sg
