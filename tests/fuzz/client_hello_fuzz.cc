// The TLS ClientHello as the ingress handles it before the handshake: OpenSSL parses the record, then our
// ClientHello callback picks the certificate by SNI (the server_name extension, parsed by hand), reads the
// ALPN list and routes the name; when it pauses for the port's policy, the handshake resumes as a connection
// resumes it, which runs the ALPN selection too. The server is the real TlsContexts with a test certificate.
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <stdlib.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "config/config.h"
#include "proxy/tls.h"
#include "tests/unit/test_cert.h"

namespace {

// TlsContexts loads certificates from files: they are written to a fresh directory under TMPDIR
// (tests/fuzz/run.sh points it into the build directory), loaded, and removed again.
std::shared_ptr<sg::TlsContexts> make_contexts() {
  const char* tmp = std::getenv("TMPDIR");
  std::string dir = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/sandgate-fuzz-XXXXXX";
  if (mkdtemp(dir.data()) == nullptr) {
    std::perror("client_hello_fuzz: mkdtemp");
    std::abort();
  }
  sg::test_support::TestCert cert;
  cert.write_pem(dir + "/cert.pem");
  cert.write_key_pem(dir + "/key.pem");
  std::string toml = "domain = \"sandbox.localhost\"\n[proxy]\nlisten = \"127.0.0.1:0\"\nktls = \"off\"\n"
                     "[[proxy.certificates]]\ncert = \"" + dir + "/cert.pem\"\nkey = \"" + dir + "/key.pem\"\n";
  auto cfg = sg::load_config_string(toml, "fuzz.toml");
  auto tls = cfg ? sg::TlsContexts::create(**cfg) : sg::Result<std::shared_ptr<sg::TlsContexts>>(cfg.failure());
  std::filesystem::remove_all(dir);
  if (!tls) {
    std::fprintf(stderr, "client_hello_fuzz: %s\n", tls.message().c_str());
    std::abort();
  }
  return *tls;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::shared_ptr<sg::TlsContexts> contexts = make_contexts();
  SSL* ssl = SSL_new(contexts->default_ctx());
  sg::HelloState hello;
  SSL_set_ex_data(ssl, sg::hello_ex_index(), &hello);
  BIO* from_client = BIO_new_mem_buf(data, static_cast<int>(size));
  // The end of the input is "no more bytes yet", as on a socket, not end of file.
  BIO_set_mem_eof_return(from_client, -1);
  SSL_set_bio(ssl, from_client, BIO_new(BIO_s_mem()));
  SSL_set_accept_state(ssl);
  int r = SSL_do_handshake(ssl);
  if (r <= 0 && SSL_get_error(ssl, r) == SSL_ERROR_WANT_CLIENT_HELLO_CB) {
    // The port's policy as the node would answer it; which one comes from the input, so both are explored.
    hello.policy_known = true;
    hello.port_protocol = size % 2 == 0 ? "h2c" : "http1";
    (void)SSL_do_handshake(ssl);
  }
  SSL_free(ssl);
  ERR_clear_error();
  return 0;
}
