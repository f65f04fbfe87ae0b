#include "proxy/ktls.h"

#include <netinet/tcp.h>
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/kdf.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <set>
#include <string>

#include "common/hex.h"
#include "common/log.h"

namespace sg {
namespace {

constexpr std::string_view kClientTrafficSecretLabel = "CLIENT_TRAFFIC_SECRET_0 ";

int tracker_ex_index() {
  static int index = SSL_get_ex_new_index(0, nullptr, nullptr, nullptr, nullptr);
  return index;
}

KtlsRxTracker* tracker_of(const SSL* ssl) { return static_cast<KtlsRxTracker*>(SSL_get_ex_data(ssl, tracker_ex_index())); }

// HKDF-Expand-Label(secret, label, "", length) from RFC 8446 section 7.1.
Status hkdf_expand_label(const EVP_MD* digest, std::span<const unsigned char> secret, std::string_view label,
                         unsigned char* out, size_t length) {
  unsigned char info[2 + 1 + 255 + 1];
  std::string full_label = "tls13 " + std::string(label);
  size_t n = 0;
  info[n++] = static_cast<unsigned char>(length >> 8);
  info[n++] = static_cast<unsigned char>(length);
  info[n++] = static_cast<unsigned char>(full_label.size());
  std::memcpy(info + n, full_label.data(), full_label.size());
  n += full_label.size();
  info[n++] = 0;  // empty context

  EVP_KDF* kdf = EVP_KDF_fetch(nullptr, OSSL_KDF_NAME_HKDF, nullptr);
  EVP_KDF_CTX* ctx = kdf ? EVP_KDF_CTX_new(kdf) : nullptr;
  EVP_KDF_free(kdf);
  if (!ctx) return fail(Error::kInternal, "HKDF is not available");
  int mode = EVP_KDF_HKDF_MODE_EXPAND_ONLY;
  OSSL_PARAM params[] = {
      OSSL_PARAM_construct_utf8_string(OSSL_KDF_PARAM_DIGEST, const_cast<char*>(EVP_MD_get0_name(digest)), 0),
      OSSL_PARAM_construct_int(OSSL_KDF_PARAM_MODE, &mode),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_KEY, const_cast<unsigned char*>(secret.data()),
                                        secret.size()),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_INFO, info, n),
      OSSL_PARAM_construct_end(),
  };
  int ok = EVP_KDF_derive(ctx, out, length, params);
  EVP_KDF_CTX_free(ctx);
  if (ok != 1) return fail(Error::kInternal, "HKDF-Expand-Label(" + std::string(label) + ") failed");
  return {};
}

void put_be64(unsigned char* out, uint64_t v) {
  for (int i = 7; i >= 0; --i) {
    out[i] = static_cast<unsigned char>(v);
    v >>= 8;
  }
}

}  // namespace

void ktls_on_keylog(const SSL* ssl, const char* line) {
  KtlsRxTracker* t = tracker_of(ssl);
  std::string_view text(line);
  if (!t || !text.starts_with(kClientTrafficSecretLabel)) return;
  // "CLIENT_TRAFFIC_SECRET_0 <client random hex> <secret hex>"
  auto space = text.rfind(' ');
  std::string_view hex = text.substr(space + 1);
  if (hex.size() / 2 > sizeof t->client_secret_) return;
  if (!hex_decode(hex, std::span(t->client_secret_, hex.size() / 2))) {  // an odd length fails too
    OPENSSL_cleanse(t->client_secret_, sizeof t->client_secret_);
    return;
  }
  t->client_secret_len_ = hex.size() / 2;
}

void ktls_on_message(int write_p, int, int content_type, const void* buf, size_t len, SSL* ssl, void*) {
  if (write_p) return;
  KtlsRxTracker* t = tracker_of(ssl);
  if (!t) return;
  if (content_type == SSL3_RT_HEADER) {
    ++t->records_read_;
  } else if (content_type == SSL3_RT_INNER_CONTENT_TYPE && t->handshake_done_ && len == 1 &&
             *static_cast<const unsigned char*>(buf) != SSL3_RT_APPLICATION_DATA) {
    t->non_data_after_handshake_ = true;
  }
}

KtlsRxTracker::~KtlsRxTracker() { OPENSSL_cleanse(client_secret_, sizeof client_secret_); }

void KtlsRxTracker::attach(SSL* ssl) { SSL_set_ex_data(ssl, tracker_ex_index(), this); }

void KtlsRxTracker::handshake_finished() {
  records_read_at_handshake_end_ = records_read_;
  handshake_done_ = true;
}

Status KtlsRxTracker::derive_rx_key(SSL* ssl, KernelTlsKey* out) const {
  if (SSL_version(ssl) != TLS1_3_VERSION) return fail(Error::kUnsupported, "not TLS 1.3");
  if (SSL_has_pending(ssl)) return fail(Error::kConflict, "OpenSSL still holds received bytes");
  if (non_data_after_handshake_)
    return fail(Error::kUnsupported, "the client sent a post-handshake message (KeyUpdate?) before the switch");
  if (client_secret_len_ == 0) return fail(Error::kInternal, "the client traffic secret was not captured");
  const SSL_CIPHER* cipher = SSL_get_current_cipher(ssl);
  return derive_tls13_kernel_key(SSL_CIPHER_get_protocol_id(cipher), SSL_CIPHER_get_handshake_digest(cipher),
                                 std::span(client_secret_, client_secret_len_),
                                 records_read_ - records_read_at_handshake_end_, out);
}

Status KtlsRxTracker::install_tls13_rx(SSL* ssl, int fd) {
  KernelTlsKey key;
  auto derived = derive_rx_key(ssl, &key);
  // The secret is not needed again: receive is the kernel's from here on, or stays with OpenSSL.
  OPENSSL_cleanse(client_secret_, sizeof client_secret_);
  client_secret_len_ = 0;
  if (!derived) return derived;
  if (::setsockopt(fd, SOL_TLS, TLS_RX, &key.info, key.size) != 0) return fail_errno("setsockopt(TLS_RX)", errno);
  return {};
}

KernelTlsKey::~KernelTlsKey() { OPENSSL_cleanse(&info, sizeof info); }

Result<void> derive_tls13_kernel_key(uint16_t cipher_suite, const EVP_MD* digest,
                                     std::span<const unsigned char> traffic_secret, uint64_t seq,
                                     KernelTlsKey* out) {
  unsigned char key[32];
  unsigned char iv[12];
  size_t key_len = 0;
  switch (cipher_suite) {
    case 0x1301: key_len = TLS_CIPHER_AES_GCM_128_KEY_SIZE; break;   // TLS_AES_128_GCM_SHA256
    case 0x1302: key_len = TLS_CIPHER_AES_GCM_256_KEY_SIZE; break;   // TLS_AES_256_GCM_SHA384
    case 0x1303: key_len = TLS_CIPHER_CHACHA20_POLY1305_KEY_SIZE; break;  // TLS_CHACHA20_POLY1305_SHA256
    default:
      return fail(Error::kUnsupported, "cipher suite 0x" + fmt::format("{:04x}", cipher_suite) +
                                           " has no kernel TLS implementation here");
  }
  if (!digest) return fail(Error::kInternal, "no handshake digest for the cipher suite");
  if (auto st = hkdf_expand_label(digest, traffic_secret, "key", key, key_len); !st) return st;
  if (auto st = hkdf_expand_label(digest, traffic_secret, "iv", iv, sizeof iv); !st) return st;

  std::memset(&out->info, 0, sizeof out->info);
  // The TLS 1.3 nonce is the 12-byte IV XOR the sequence number. The kernel's AES-GCM structures split it
  // into a 4-byte salt and an 8-byte "iv", as for TLS 1.2; ChaCha20-Poly1305 takes all 12 bytes as iv.
  switch (cipher_suite) {
    case 0x1301: {
      auto& i = out->info.aes_gcm_128;
      i.info.version = TLS_1_3_VERSION;
      i.info.cipher_type = TLS_CIPHER_AES_GCM_128;
      std::memcpy(i.key, key, sizeof i.key);
      std::memcpy(i.salt, iv, sizeof i.salt);
      std::memcpy(i.iv, iv + sizeof i.salt, sizeof i.iv);
      put_be64(i.rec_seq, seq);
      out->size = sizeof i;
      break;
    }
    case 0x1302: {
      auto& i = out->info.aes_gcm_256;
      i.info.version = TLS_1_3_VERSION;
      i.info.cipher_type = TLS_CIPHER_AES_GCM_256;
      std::memcpy(i.key, key, sizeof i.key);
      std::memcpy(i.salt, iv, sizeof i.salt);
      std::memcpy(i.iv, iv + sizeof i.salt, sizeof i.iv);
      put_be64(i.rec_seq, seq);
      out->size = sizeof i;
      break;
    }
    default: {
      auto& i = out->info.chacha20_poly1305;
      i.info.version = TLS_1_3_VERSION;
      i.info.cipher_type = TLS_CIPHER_CHACHA20_POLY1305;
      std::memcpy(i.key, key, sizeof i.key);
      std::memcpy(i.iv, iv, sizeof i.iv);
      put_be64(i.rec_seq, seq);
      out->size = sizeof i;
      break;
    }
  }
  OPENSSL_cleanse(key, sizeof key);
  OPENSSL_cleanse(iv, sizeof iv);
  return {};
}

void enable_ktls_rx_tracking(SSL_CTX* ctx) {
  SSL_CTX_set_keylog_callback(ctx, ktls_on_keylog);
  SSL_CTX_set_msg_callback(ctx, ktls_on_message);
}

ssize_t recv_tls_record(int fd, char* buf, size_t capacity, uint8_t* record_type) {
  char control[CMSG_SPACE(sizeof(uint8_t))];
  iovec iov{buf, capacity};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t n = ::recvmsg(fd, &msg, MSG_DONTWAIT);
  if (n < 0) return n;
  // Without the cmsg (a socket without kTLS receive) the bytes are application data.
  *record_type = SSL3_RT_APPLICATION_DATA;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
    if (c->cmsg_level == SOL_TLS && c->cmsg_type == TLS_GET_RECORD_TYPE) *record_type = *CMSG_DATA(c);
  return n;
}

ssize_t send_tls_record(int fd, uint8_t record_type, const void* payload, size_t size) {
  char control[CMSG_SPACE(sizeof record_type)] = {};
  iovec iov{const_cast<void*>(payload), size};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_TLS;
  c->cmsg_type = TLS_SET_RECORD_TYPE;
  c->cmsg_len = CMSG_LEN(sizeof record_type);
  *CMSG_DATA(c) = record_type;
  return ::sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
}

void log_ktls_fallback_once(std::string_view reason) {
  static std::mutex mu;
  static std::set<std::string, std::less<>> logged;
  std::lock_guard lock(mu);
  if (logged.contains(reason)) return;
  logged.emplace(reason);
  spdlog::info("kTLS not used ({}); such connections take the userspace TLS path (logged once)", reason);
}

}  // namespace sg
