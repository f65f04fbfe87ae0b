// The proxy's TLS contexts (proxy/tls.*) as a client sees them: how many TLS 1.3 session tickets a full
// handshake brings, and that a ticket resumes.
#include "proxy/tls.h"

#include <gtest/gtest.h>
#include <openssl/ssl.h>
#include <sys/socket.h>

#include <filesystem>
#include <string>

#include "common/fd.h"
#include "config/config.h"
#include "tests/unit/temp_dir.h"
#include "tests/unit/test_cert.h"
#include "tests/unit/tls_handshake.h"

namespace sg {
namespace {

class TlsContextsTest : public ::testing::Test {
 protected:
  std::shared_ptr<TlsContexts> contexts(const std::string& proxy_extra) {
    cert_.write_pem(dir_.path() + "/cert.pem");
    cert_.write_key_pem(dir_.path() + "/key.pem");
    auto cfg = load_config_string("[proxy]\nktls = \"off\"\n" + proxy_extra + "\n[[proxy.certificates]]\ncert = \"" +
                                      dir_.path() + "/cert.pem\"\nkey = \"" + dir_.path() + "/key.pem\"\n",
                                  "test.toml");
    EXPECT_TRUE(cfg) << cfg.message();
    if (!cfg) return nullptr;
    auto tls = TlsContexts::create(**cfg);
    EXPECT_TRUE(tls) << tls.message();
    return tls ? *tls : nullptr;
  }

  struct Outcome {
    int tickets = 0;  // NewSessionTicket messages the client received
    bool resumed = false;
    SSL_SESSION* session = nullptr;  // the last ticket's session (the caller frees it)
  };

  // One TLS 1.3 connection over a socketpair, both ends in this thread: the handshake, a request and its
  // answer (the client reads the tickets before the answer). `resume`: a session to offer.
  static Outcome connect(TlsContexts& tls, SSL_SESSION* resume) {
    Outcome out;
    int sv[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv), 0);
    UniqueFd server_fd(sv[0]), client_fd(sv[1]);
    SSL_CTX* client_ctx = SSL_CTX_new(TLS_client_method());
    SSL_CTX_set_session_cache_mode(client_ctx, SSL_SESS_CACHE_CLIENT | SSL_SESS_CACHE_NO_INTERNAL_STORE);
    SSL_CTX_set_app_data(client_ctx, &out);
    SSL_CTX_sess_set_new_cb(client_ctx, [](SSL* ssl, SSL_SESSION* session) {
      auto* o = static_cast<Outcome*>(SSL_CTX_get_app_data(SSL_get_SSL_CTX(ssl)));
      ++o->tickets;
      if (o->session) SSL_SESSION_free(o->session);
      o->session = session;  // kept: returning 1 takes the reference
      return 1;
    });
    SSL* client = SSL_new(client_ctx);
    SSL_set_fd(client, client_fd.get());
    SSL_set_tlsext_host_name(client, "8080-demo.sandbox.localhost");
    if (resume) SSL_set_session(client, resume);
    SSL_set_connect_state(client);
    SSL* server = SSL_new(tls.default_ctx());
    HelloState hello;
    SSL_set_ex_data(server, hello_ex_index(), &hello);
    SSL_set_fd(server, server_fd.get());
    SSL_set_accept_state(server);
    EXPECT_TRUE(test_support::handshake_in_turn(client, server, hello)) << "the handshake failed or did not finish";
    const std::string request = "GET / HTTP/1.1\r\n\r\n", answer = "HTTP/1.1 204 No Content\r\n\r\n";
    EXPECT_EQ(SSL_write(client, request.data(), static_cast<int>(request.size())), static_cast<int>(request.size()));
    char buf[256];
    EXPECT_EQ(SSL_read(server, buf, sizeof buf), static_cast<int>(request.size()));
    EXPECT_EQ(SSL_write(server, answer.data(), static_cast<int>(answer.size())), static_cast<int>(answer.size()));
    EXPECT_EQ(SSL_read(client, buf, sizeof buf), static_cast<int>(answer.size()));
    out.resumed = SSL_session_reused(client) == 1;
    // A client that leaves without close_notify has its session marked not resumable by SSL_free.
    SSL_shutdown(client);
    SSL_free(server);
    SSL_free(client);
    SSL_CTX_free(client_ctx);
    return out;
  }

  testing::TempDir dir_;
  test_support::TestCert cert_;
};

TEST_F(TlsContextsTest, AFullHandshakeBringsTheConfiguredTicketsAndOneResumes) {
  for (uint32_t tickets : {0u, 1u, 2u}) {
    auto tls = contexts("tls13_session_tickets = " + std::to_string(tickets));
    ASSERT_TRUE(tls);
    Outcome full = connect(*tls, nullptr);
    EXPECT_FALSE(full.resumed);
    EXPECT_EQ(full.tickets, static_cast<int>(tickets)) << "after a full handshake";
    if (tickets == 0) {
      EXPECT_EQ(full.session, nullptr);
      continue;
    }
    ASSERT_NE(full.session, nullptr);
    Outcome again = connect(*tls, full.session);
    SSL_SESSION_free(full.session);
    EXPECT_TRUE(again.resumed) << "the ticket resumes";
    EXPECT_EQ(again.tickets, 1) << "a resumed handshake brings one fresh ticket, whatever the setting";
    if (again.session) SSL_SESSION_free(again.session);
  }
  // The default: one.
  auto tls = contexts("");
  ASSERT_TRUE(tls);
  Outcome full = connect(*tls, nullptr);
  EXPECT_EQ(full.tickets, 1);
  if (full.session) SSL_SESSION_free(full.session);
}

}  // namespace
}  // namespace sg
