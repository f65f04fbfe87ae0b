#include "proxy/ktls.h"

#include <netinet/tcp.h>
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <set>
#include <string>

#include "common/hex.h"
#include "common/log.h"
#include "proxy/keylog_format.h"
#include "proxy/tls13_record_layer.h"

namespace sg {
namespace {

constexpr std::string_view kClientTrafficSecretLabel = "CLIENT_TRAFFIC_SECRET_0 ";
constexpr std::string_view kServerTrafficSecretLabel = "SERVER_TRAFFIC_SECRET_0 ";

// "<label> <client random hex> <secret hex>" into `secret`; false (and `secret` wiped) when malformed.
bool decode_secret(std::string_view line, unsigned char (&secret)[64], size_t* len) {
  std::string_view hex = line.substr(line.rfind(' ') + 1);
  *len = 0;
  if (hex.size() / 2 > sizeof secret) return false;
  if (!hex_decode(hex, std::span(secret, hex.size() / 2))) {  // an odd length fails too
    OPENSSL_cleanse(secret, sizeof secret);
    return false;
  }
  *len = hex.size() / 2;
  return true;
}

int tracker_ex_index() {
  static int index = SSL_get_ex_new_index(0, nullptr, nullptr, nullptr, nullptr);
  return index;
}

Tls13SecretTracker* tracker_of(const SSL* ssl) { return static_cast<Tls13SecretTracker*>(SSL_get_ex_data(ssl, tracker_ex_index())); }

}  // namespace

Status tls13_hkdf_expand_labels(const EVP_MD* digest, std::span<const unsigned char> secret,
                                std::initializer_list<Tls13Label> labels) {
  // HKDF-Expand (RFC 5869) of at most one hash length is a single HMAC: T(1) = HMAC(secret, info || 0x01).
  // One HMAC context keyed once for all the labels; the MAC is fetched once per process.
  static EVP_MAC* const hmac = EVP_MAC_fetch(nullptr, OSSL_MAC_NAME_HMAC, nullptr);
  const size_t hash_len = static_cast<size_t>(EVP_MD_get_size(digest));
  EVP_MAC_CTX* ctx = hmac ? EVP_MAC_CTX_new(hmac) : nullptr;
  if (!ctx) return fail(Error::kInternal, "HMAC is not available");
  OSSL_PARAM params[] = {
      OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, const_cast<char*>(EVP_MD_get0_name(digest)), 0),
      OSSL_PARAM_construct_end(),
  };
  Status result;
  bool keyed = false;
  for (const Tls13Label& l : labels) {
    constexpr std::string_view kPrefix = "tls13 ";
    unsigned char info[2 + 1 + 255 + 1 + 1];
    if (l.length > hash_len || kPrefix.size() + l.label.size() > 255) {
      result = fail(Error::kInternal, "HKDF-Expand-Label(" + std::string(l.label) + "): bad length");
      break;
    }
    size_t n = 0;
    info[n++] = static_cast<unsigned char>(l.length >> 8);
    info[n++] = static_cast<unsigned char>(l.length);
    info[n++] = static_cast<unsigned char>(kPrefix.size() + l.label.size());
    std::memcpy(info + n, kPrefix.data(), kPrefix.size());
    n += kPrefix.size();
    std::memcpy(info + n, l.label.data(), l.label.size());
    n += l.label.size();
    info[n++] = 0;  // empty context
    info[n++] = 1;  // the block counter of T(1)
    unsigned char t[EVP_MAX_MD_SIZE];
    size_t t_len = 0;
    // The first init sets the key and the hash; the next ones start over with the same key.
    const bool ok = (keyed ? EVP_MAC_init(ctx, nullptr, 0, nullptr) : EVP_MAC_init(ctx, secret.data(), secret.size(), params)) == 1 &&
                    EVP_MAC_update(ctx, info, n) == 1 && EVP_MAC_final(ctx, t, &t_len, sizeof t) == 1 && t_len == hash_len;
    keyed = true;
    if (ok) std::memcpy(l.out, t, l.length);
    OPENSSL_cleanse(t, sizeof t);
    if (!ok) {
      result = fail(Error::kInternal, "HKDF-Expand-Label(" + std::string(l.label) + ") failed");
      break;
    }
  }
  EVP_MAC_CTX_free(ctx);
  return result;
}

Status tls13_hkdf_expand_label(const EVP_MD* digest, std::span<const unsigned char> secret, std::string_view label,
                               unsigned char* out, size_t length) {
  return tls13_hkdf_expand_labels(digest, secret, {{label, out, length}});
}

namespace {

void put_be64(unsigned char* out, uint64_t v) {
  for (int i = 7; i >= 0; --i) {
    out[i] = static_cast<unsigned char>(v);
    v >>= 8;
  }
}

}  // namespace

void ktls_on_keylog(const SSL* ssl, const char* line) {
  Tls13SecretTracker* t = tracker_of(ssl);
  if (!t) return;
  std::string_view text(line);
  if (text.starts_with(kClientTrafficSecretLabel)) decode_secret(text, t->client_secret_, &t->client_secret_len_);
  else if (text.starts_with(kServerTrafficSecretLabel)) decode_secret(text, t->server_secret_, &t->server_secret_len_);
}

void ktls_on_message(int write_p, int, int content_type, const void* buf, size_t len, SSL* ssl, void*) {
  Tls13SecretTracker* t = tracker_of(ssl);
  if (!t) return;
  const auto* bytes = static_cast<const unsigned char*>(buf);
  if (write_p) {
    // A handshake message is reported after the records that carried it.
    if (content_type == SSL3_RT_HEADER) {
      ++t->records_written_;
    } else if (content_type == SSL3_RT_HANDSHAKE && len >= 1 && bytes[0] == SSL3_MT_FINISHED) {
      t->records_written_at_server_finished_ = t->records_written_;
      t->server_finished_written_ = true;
    }
    return;
  }
  if (content_type == SSL3_RT_HEADER) {
    ++t->records_read_;
    t->inside_read_record_ = true;  // its header is read; its body may not be yet
  } else if (content_type == SSL3_RT_INNER_CONTENT_TYPE) {
    t->inside_read_record_ = false;  // decrypted whole
  }
  if (content_type == SSL3_RT_INNER_CONTENT_TYPE && t->handshake_done_ && len == 1 &&
      bytes[0] != SSL3_RT_APPLICATION_DATA)
    t->non_data_after_handshake_ = true;
}

Tls13SecretTracker::~Tls13SecretTracker() { wipe_secrets(); }

void Tls13SecretTracker::wipe_secrets() {
  OPENSSL_cleanse(client_secret_, sizeof client_secret_);
  OPENSSL_cleanse(server_secret_, sizeof server_secret_);
  client_secret_len_ = server_secret_len_ = 0;
}

void Tls13SecretTracker::attach(SSL* ssl) { SSL_set_ex_data(ssl, tracker_ex_index(), this); }
void Tls13SecretTracker::detach(SSL* ssl) { SSL_set_ex_data(ssl, tracker_ex_index(), nullptr); }

void Tls13SecretTracker::handshake_finished() {
  records_read_at_handshake_end_ = records_read_;
  handshake_done_ = true;
}

Status Tls13SecretTracker::ready_to_leave_openssl(SSL* ssl) const {
  if (SSL_version(ssl) != TLS1_3_VERSION) return fail(Error::kUnsupported, "not TLS 1.3");
  if (non_data_after_handshake_)
    return fail(Error::kUnsupported, "the client sent a post-handshake message (KeyUpdate?) before the switch");
  if (client_secret_len_ == 0) return fail(Error::kInternal, "the client traffic secret was not captured");
  if (SSL_has_pending(ssl) || inside_read_record_) return fail(Error::kConflict, "OpenSSL still holds received bytes");
  return {};
}

Status Tls13SecretTracker::derive_rx_key(SSL* ssl, KernelTlsKey* out) const {
  if (auto st = ready_to_leave_openssl(ssl); !st) return st;
  const SSL_CIPHER* cipher = SSL_get_current_cipher(ssl);
  return derive_tls13_kernel_key(SSL_CIPHER_get_protocol_id(cipher), SSL_CIPHER_get_handshake_digest(cipher),
                                 std::span(client_secret_, client_secret_len_),
                                 records_read_ - records_read_at_handshake_end_, out);
}

Status Tls13SecretTracker::install_tls13_rx(SSL* ssl, int fd) {
  KernelTlsKey key;
  auto derived = derive_rx_key(ssl, &key);
  // The secrets are not needed again: receive is the kernel's from here on, or stays with OpenSSL.
  wipe_secrets();
  if (!derived) return derived;
  if (::setsockopt(fd, SOL_TLS, TLS_RX, &key.info, key.size) != 0) return fail_errno("setsockopt(TLS_RX)", errno);
  return {};
}

Result<std::unique_ptr<Tls13RecordLayer>> Tls13SecretTracker::take_record_layer(SSL* ssl) {
  auto layer = [&]() -> Result<std::unique_ptr<Tls13RecordLayer>> {
    if (!handshake_done_ || !server_finished_written_) return fail(Error::kConflict, "the handshake is not over");
    if (auto st = ready_to_leave_openssl(ssl); !st) return st.failure();
    if (server_secret_len_ == 0) return fail(Error::kInternal, "the server traffic secret was not captured");
    const SSL_CIPHER* cipher = SSL_get_current_cipher(ssl);
    return Tls13RecordLayer::create({
        .cipher_suite = SSL_CIPHER_get_protocol_id(cipher),
        .digest = SSL_CIPHER_get_handshake_digest(cipher),
        .client_secret = std::span(client_secret_, client_secret_len_),
        .client_seq = records_read_ - records_read_at_handshake_end_,
        .server_secret = std::span(server_secret_, server_secret_len_),
        .server_seq = records_written_ - records_written_at_server_finished_,
    });
  }();
  if (layer || layer.error() != Error::kConflict) wipe_secrets();
  return layer;
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
  if (auto st = tls13_hkdf_expand_labels(digest, traffic_secret, {{"key", key, key_len}, {"iv", iv, sizeof iv}}); !st)
    return st;

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

void enable_tls13_secret_tracking(SSL_CTX* ctx) {
  // With a keylog callback OpenSSL formats every secret as hex; proxy/keylog_format.h keeps that cheap.
  static const bool fast_hex = [] {
    bool in_use = keylog_hex_fast_path_in_use();
    if (!in_use) spdlog::warn("OpenSSL's keylog hex goes through glibc's sprintf: about 25 us more per handshake");
    return in_use;
  }();
  (void)fast_hex;
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
