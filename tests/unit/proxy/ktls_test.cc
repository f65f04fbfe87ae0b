// The TLS 1.3 receive handover (proxy/ktls.*) checked without kernel TLS: a real OpenSSL handshake over a
// socket pair, the server reads some records through SSL_read as the proxy does with the request head, and
// the key and sequence number the kernel would be given must decrypt the next record taken raw off the socket.
#include "proxy/ktls.h"

#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

namespace sg {
namespace {

struct Pair {
  SSL_CTX* server_ctx = nullptr;
  SSL_CTX* client_ctx = nullptr;
  SSL* server = nullptr;
  SSL* client = nullptr;
  int server_fd = -1;
  int client_fd = -1;
  Tls13SecretTracker tracker;

  ~Pair() {
    SSL_free(server);
    SSL_free(client);
    SSL_CTX_free(server_ctx);
    SSL_CTX_free(client_ctx);
    ::close(server_fd);
    ::close(client_fd);
  }
};

// A self-signed P-256 certificate, made in memory.
void use_test_certificate(SSL_CTX* ctx) {
  EVP_PKEY* key = EVP_EC_gen("P-256");
  X509* cert = X509_new();
  ASN1_INTEGER_set(X509_get_serialNumber(cert), 1);
  X509_gmtime_adj(X509_getm_notBefore(cert), 0);
  X509_gmtime_adj(X509_getm_notAfter(cert), 3600);
  X509_set_pubkey(cert, key);
  X509_NAME_add_entry_by_txt(X509_get_subject_name(cert), "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>("test"), -1, -1, 0);
  X509_set_issuer_name(cert, X509_get_subject_name(cert));
  X509_sign(cert, key, EVP_sha256());
  SSL_CTX_use_certificate(ctx, cert);
  SSL_CTX_use_PrivateKey(ctx, key);
  X509_free(cert);
  EVP_PKEY_free(key);
}

void handshake(Pair& p, const char* suite) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, fds), 0);
  p.server_fd = fds[0];
  p.client_fd = fds[1];
  p.server_ctx = SSL_CTX_new(TLS_server_method());
  p.client_ctx = SSL_CTX_new(TLS_client_method());
  use_test_certificate(p.server_ctx);
  enable_tls13_secret_tracking(p.server_ctx);
  SSL_CTX_set_min_proto_version(p.client_ctx, TLS1_3_VERSION);
  SSL_CTX_set_ciphersuites(p.client_ctx, suite);
  p.server = SSL_new(p.server_ctx);
  p.client = SSL_new(p.client_ctx);
  SSL_set_fd(p.server, p.server_fd);
  SSL_set_fd(p.client, p.client_fd);
  SSL_set_accept_state(p.server);
  SSL_set_connect_state(p.client);
  p.tracker.attach(p.server);
  bool server_done = false;
  bool client_done = false;
  for (int i = 0; i < 100 && !(server_done && client_done); ++i) {
    if (!client_done) client_done = SSL_do_handshake(p.client) == 1;
    if (!server_done && SSL_do_handshake(p.server) == 1) {
      server_done = true;
      p.tracker.handshake_finished();
    }
  }
  ASSERT_TRUE(server_done && client_done);
  // The client takes the session tickets the server sent with its handshake, as a real client does.
  char none[1];
  SSL_read(p.client, none, sizeof none);
}

void client_sends(Pair& p, const std::string& data) {
  ASSERT_EQ(SSL_write(p.client, data.data(), static_cast<int>(data.size())), static_cast<int>(data.size()));
}

std::string server_reads(Pair& p, size_t max) {
  std::string buf(max, '\0');
  int n = SSL_read(p.server, buf.data(), static_cast<int>(max));
  return n > 0 ? buf.substr(0, static_cast<size_t>(n)) : std::string();
}

// Decrypts the next record on the server socket as the kernel would with `key`; "" when it does not
// authenticate.
std::string decrypt_next_record(int fd, const KernelTlsKey& key) {
  unsigned char header[5];
  if (::recv(fd, header, sizeof header, MSG_WAITALL) != 5) return {};
  size_t len = size_t(header[3]) << 8 | header[4];
  std::vector<unsigned char> body(len);
  if (::recv(fd, body.data(), len, MSG_WAITALL) != static_cast<ssize_t>(len) || len < 17) return {};

  unsigned char nonce[12];
  const unsigned char* seq = nullptr;
  const unsigned char* aead_key = nullptr;
  const EVP_CIPHER* cipher = nullptr;
  switch (key.info.aes_gcm_128.info.cipher_type) {
    case TLS_CIPHER_AES_GCM_128:
      std::memcpy(nonce, key.info.aes_gcm_128.salt, 4);
      std::memcpy(nonce + 4, key.info.aes_gcm_128.iv, 8);
      seq = key.info.aes_gcm_128.rec_seq;
      aead_key = key.info.aes_gcm_128.key;
      cipher = EVP_aes_128_gcm();
      break;
    case TLS_CIPHER_AES_GCM_256:
      std::memcpy(nonce, key.info.aes_gcm_256.salt, 4);
      std::memcpy(nonce + 4, key.info.aes_gcm_256.iv, 8);
      seq = key.info.aes_gcm_256.rec_seq;
      aead_key = key.info.aes_gcm_256.key;
      cipher = EVP_aes_256_gcm();
      break;
    default:
      std::memcpy(nonce, key.info.chacha20_poly1305.iv, 12);
      seq = key.info.chacha20_poly1305.rec_seq;
      aead_key = key.info.chacha20_poly1305.key;
      cipher = EVP_chacha20_poly1305();
  }
  for (int i = 0; i < 8; ++i) nonce[4 + i] ^= seq[i];

  size_t text_len = len - 16;
  std::vector<unsigned char> text(text_len);
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  int out = 0;
  bool ok = EVP_DecryptInit_ex(ctx, cipher, nullptr, nullptr, nullptr) == 1 &&
            EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_AEAD_SET_IVLEN, 12, nullptr) == 1 &&
            EVP_DecryptInit_ex(ctx, nullptr, nullptr, aead_key, nonce) == 1 &&
            EVP_DecryptUpdate(ctx, nullptr, &out, header, sizeof header) == 1 &&
            EVP_DecryptUpdate(ctx, text.data(), &out, body.data(), static_cast<int>(text_len)) == 1 &&
            EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_AEAD_SET_TAG, 16, body.data() + text_len) == 1 &&
            EVP_DecryptFinal_ex(ctx, text.data() + out, &out) == 1;
  EVP_CIPHER_CTX_free(ctx);
  if (!ok) return {};
  // TLSInnerPlaintext: content, then the real content type, then zero padding.
  while (!text.empty() && text.back() == 0) text.pop_back();
  if (text.empty() || text.back() != SSL3_RT_APPLICATION_DATA) return {};
  text.pop_back();
  return std::string(text.begin(), text.end());
}

class KtlsRxKey : public ::testing::TestWithParam<const char*> {};

TEST_P(KtlsRxKey, DecryptsTheRecordAfterThoseOpenSslRead) {
  Pair p;
  handshake(p, GetParam());
  client_sends(p, "GET / HTTP/1.1\r\nHost: x\r\n\r\n");
  client_sends(p, "a second record");
  EXPECT_EQ(server_reads(p, 4096), "GET / HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(server_reads(p, 4096), "a second record");
  ASSERT_FALSE(SSL_has_pending(p.server));
  client_sends(p, "the first record for the kernel");

  KernelTlsKey key;
  auto st = p.tracker.derive_rx_key(p.server, &key);
  ASSERT_TRUE(st) << st.message();
  EXPECT_EQ(key.info.aes_gcm_128.info.version, TLS_1_3_VERSION);
  EXPECT_EQ(decrypt_next_record(p.server_fd, key), "the first record for the kernel");
}

INSTANTIATE_TEST_SUITE_P(Suites, KtlsRxKey,
                         ::testing::Values("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384",
                                           "TLS_CHACHA20_POLY1305_SHA256"));

TEST(KtlsRxHandover, WaitsWhileOpenSslHoldsPartOfARecord) {
  Pair p;
  handshake(p, "TLS_AES_128_GCM_SHA256");
  client_sends(p, "0123456789");
  EXPECT_EQ(server_reads(p, 4), "0123");
  KernelTlsKey key;
  auto st = p.tracker.derive_rx_key(p.server, &key);
  EXPECT_FALSE(st);
  EXPECT_EQ(st.error(), Error::kConflict);
}

TEST(KtlsRxHandover, RefusesAfterAKeyUpdate) {
  Pair p;
  handshake(p, "TLS_AES_128_GCM_SHA256");
  ASSERT_EQ(SSL_key_update(p.client, SSL_KEY_UPDATE_NOT_REQUESTED), 1);
  client_sends(p, "after the update");
  EXPECT_EQ(server_reads(p, 4096), "after the update");
  KernelTlsKey key;
  auto st = p.tracker.derive_rx_key(p.server, &key);
  EXPECT_FALSE(st);
  EXPECT_EQ(st.error(), Error::kUnsupported);
}

TEST(KtlsRxHandover, AnUnknownSuiteHasNoKernelKey) {
  unsigned char secret[32] = {1};
  KernelTlsKey key;
  auto st = derive_tls13_kernel_key(0x1304 /* TLS_AES_128_CCM_SHA256 */, EVP_sha256(), secret, 0, &key);
  EXPECT_FALSE(st);
  EXPECT_EQ(st.error(), Error::kUnsupported);
}

}  // namespace
}  // namespace sg
