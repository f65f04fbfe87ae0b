#include "proxy/keylog_format.h"

#include <gtest/gtest.h>
#include <openssl/ssl.h>

#include <cstdarg>
#include <cstdio>
#include <string>
#include <vector>

#include "tests/unit/test_cert.h"

extern "C" int __sprintf_chk(char* out, int flag, size_t out_size, const char* format, ...);

namespace sg {
namespace {

std::string glibc_format(const char* format, ...) {
  char out[64];
  va_list args;
  va_start(args, format);
  std::vsnprintf(out, sizeof out, format, args);
  va_end(args);
  return out;
}

TEST(KeylogFormat, LibsslCallsReachTheFastPathInThisProcess) {
  // The test binary links keylog_format.cc through sg_proxy as the proxy does (ktls.cc asks for it).
  EXPECT_TRUE(keylog_hex_fast_path_in_use());
}

TEST(KeylogFormat, EveryByteIsWhatGlibcWrites) {
  for (unsigned value = 0; value < 256; ++value) {
    char out[3] = {'?', '?', '?'};
    EXPECT_EQ(__sprintf_chk(out, 1, sizeof out, "%02x", value), 2);
    EXPECT_EQ(std::string(out), glibc_format("%02x", value)) << value;
  }
}

TEST(KeylogFormat, OtherCallsAreGlibcs) {
  char out[64];
  // A value wider than two digits, other formats, several arguments.
  EXPECT_EQ(__sprintf_chk(out, 1, sizeof out, "%02x", 0x1234u), 4);
  EXPECT_STREQ(out, "1234");
  EXPECT_EQ(__sprintf_chk(out, 1, sizeof out, "%02X", 0xabu), 2);
  EXPECT_STREQ(out, "AB");
  EXPECT_EQ(__sprintf_chk(out, 1, sizeof out, "%02x%02x", 1u, 0xfeu), 4);
  EXPECT_STREQ(out, "01fe");
  EXPECT_EQ(__sprintf_chk(out, 1, sizeof out, "%s-%d", "port", 8080), 9);
  EXPECT_STREQ(out, "port-8080");
}

TEST(KeylogFormat, ABufferTooSmallStillAbortsAsGlibcDoes) {
  char out[2];
#ifdef SANDGATE_SANITIZED
  // AddressSanitizer's __vsprintf_chk reports the overflow itself.
  EXPECT_DEATH(__sprintf_chk(out, 1, sizeof out, "%02x", 0xabu), "");
#else
  EXPECT_DEATH(__sprintf_chk(out, 1, sizeof out, "%02x", 0xabu), "buffer overflow detected");
#endif
}

TEST(KeylogFormat, TheKeylogLinesOpenSslWritesAreHexOfTheSecrets) {
  // A TLS 1.3 handshake in memory: the server's keylog lines go through the fast path and still carry the
  // client random and secrets as lowercase hex, as SSLKEYLOGFILE readers expect.
  SSL_CTX* server_ctx = SSL_CTX_new(TLS_server_method());
  SSL_CTX* client_ctx = SSL_CTX_new(TLS_client_method());
  ASSERT_TRUE(server_ctx && client_ctx);
  static std::vector<std::string> lines;
  lines.clear();
  SSL_CTX_set_keylog_callback(client_ctx, [](const SSL*, const char* line) { lines.emplace_back(line); });
  test_support::TestCert cert;
  ASSERT_EQ(SSL_CTX_use_certificate(server_ctx, cert.cert), 1);
  ASSERT_EQ(SSL_CTX_use_PrivateKey(server_ctx, cert.key), 1);
  SSL* server = SSL_new(server_ctx);
  SSL* client = SSL_new(client_ctx);
  BIO *server_bio, *client_bio;
  ASSERT_EQ(BIO_new_bio_pair(&server_bio, 0, &client_bio, 0), 1);
  SSL_set_bio(server, server_bio, server_bio);
  SSL_set_bio(client, client_bio, client_bio);
  SSL_set_accept_state(server);
  SSL_set_connect_state(client);
  for (int i = 0; i < 10 && !(SSL_is_init_finished(server) && SSL_is_init_finished(client)); ++i) {
    SSL_do_handshake(client);
    SSL_do_handshake(server);
  }
  ASSERT_TRUE(SSL_is_init_finished(server) && SSL_is_init_finished(client));
  unsigned char random[SSL3_RANDOM_SIZE];
  ASSERT_EQ(SSL_get_client_random(client, random, sizeof random), sizeof random);
  std::string random_hex;
  for (unsigned char b : random) random_hex += glibc_format("%02x", b);
  ASSERT_EQ(lines.size(), 5u);
  for (const std::string& line : lines) {
    SCOPED_TRACE(line);
    size_t space = line.find(' ');
    ASSERT_NE(space, std::string::npos);
    EXPECT_EQ(line.substr(space + 1, random_hex.size()), random_hex);
    std::string secret = line.substr(space + 1 + random_hex.size() + 1);
    EXPECT_TRUE(secret.size() == 64 || secret.size() == 96);
    EXPECT_EQ(secret.find_first_not_of("0123456789abcdef"), std::string::npos);
  }
  SSL_free(server);
  SSL_free(client);
  SSL_CTX_free(server_ctx);
  SSL_CTX_free(client_ctx);
}

}  // namespace
}  // namespace sg
