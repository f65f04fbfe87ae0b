// The proxy's TLS contexts (proxy/tls.*) as a client sees them: how many TLS 1.3 session tickets a full
// handshake brings, that a ticket resumes (also on the contexts of a reload, and across the rotations of the
// ticket keys, proxy/ticket_keys.*), and that a certificate file's chain is what the client gets.
#include "proxy/tls.h"

#include <gtest/gtest.h>
#include <openssl/rand.h>
#include <openssl/ssl.h>
#include <sys/socket.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "common/base64.h"
#include "common/fd.h"
#include "config/config.h"
#include "tests/unit/temp_dir.h"
#include "tests/unit/test_cert.h"
#include "tests/unit/tls_handshake.h"

namespace sg {
namespace {

class TlsContextsTest : public ::testing::Test {
 protected:
  // With the certificate file written already (written_ true), else from cert_.
  std::shared_ptr<TlsContexts> contexts(const std::string& proxy_extra, std::shared_ptr<TicketKeys> keys = nullptr) {
    if (!written_) {
      cert_.write_pem(dir_.path() + "/cert.pem");
      cert_.write_key_pem(dir_.path() + "/key.pem");
    }
    auto cfg = load_config_string("[proxy]\nktls = \"off\"\n" + proxy_extra + "\n[[proxy.certificates]]\ncert = \"" +
                                      dir_.path() + "/cert.pem\"\nkey = \"" + dir_.path() + "/key.pem\"\n",
                                  "test.toml");
    EXPECT_TRUE(cfg) << cfg.message();
    if (!cfg) return nullptr;
    auto tls = TlsContexts::create(**cfg, std::move(keys));
    EXPECT_TRUE(tls) << tls.message();
    return tls ? *tls : nullptr;
  }

  struct Outcome {
    int tickets = 0;  // NewSessionTicket messages the client received
    bool resumed = false;
    SSL_SESSION* session = nullptr;  // the last ticket's session (the caller frees it)
    int chain_length = 0;            // certificates the server sent
    bool handshake_done = false;     // false: either end failed, and nothing else was tried
    std::string ticket;              // the ticket the client holds at the end (TLS 1.2: renewed or not)
  };

  // One TLS 1.3 connection over a socketpair, both ends in this thread: the handshake, a request and its
  // answer (the client reads the tickets before the answer). `resume`: a session to offer.
  // `trust`: the client verifies the server's certificate against it (the handshake fails otherwise).
  // `max_version`: the newest TLS version the client offers (0: OpenSSL's, TLS 1.3).
  static Outcome connect(TlsContexts& tls, SSL_SESSION* resume, X509* trust = nullptr, int max_version = 0) {
    Outcome out;
    int sv[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv), 0);
    UniqueFd server_fd(sv[0]), client_fd(sv[1]);
    SSL_CTX* client_ctx = SSL_CTX_new(TLS_client_method());
    if (max_version != 0) SSL_CTX_set_max_proto_version(client_ctx, max_version);
    if (trust) {
      X509_STORE_add_cert(SSL_CTX_get_cert_store(client_ctx), trust);
      SSL_CTX_set_verify(client_ctx, SSL_VERIFY_PEER, nullptr);
    }
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
    out.handshake_done = test_support::handshake_in_turn(client, server, hello);
    if (!out.handshake_done) {
      SSL_free(server);
      SSL_free(client);
      SSL_CTX_free(client_ctx);
      return out;
    }
    const std::string request = "GET / HTTP/1.1\r\n\r\n", answer = "HTTP/1.1 204 No Content\r\n\r\n";
    EXPECT_EQ(SSL_write(client, request.data(), static_cast<int>(request.size())), static_cast<int>(request.size()));
    char buf[256];
    EXPECT_EQ(SSL_read(server, buf, sizeof buf), static_cast<int>(request.size()));
    EXPECT_EQ(SSL_write(server, answer.data(), static_cast<int>(answer.size())), static_cast<int>(answer.size()));
    EXPECT_EQ(SSL_read(client, buf, sizeof buf), static_cast<int>(answer.size()));
    out.resumed = SSL_session_reused(client) == 1;
    if (SSL_SESSION* held = SSL_get_session(client); held != nullptr && SSL_SESSION_has_ticket(held)) {
      const unsigned char* bytes = nullptr;
      size_t len = 0;
      SSL_SESSION_get0_ticket(held, &bytes, &len);
      out.ticket.assign(reinterpret_cast<const char*>(bytes), len);
    }
    STACK_OF(X509)* sent = SSL_get_peer_cert_chain(client);
    out.chain_length = sent ? sk_X509_num(sent) : 0;
    // A client that leaves without close_notify has its session marked not resumable by SSL_free.
    SSL_shutdown(client);
    SSL_free(server);
    SSL_free(client);
    SSL_CTX_free(client_ctx);
    return out;
  }

  testing::TempDir dir_;
  test_support::TestCert cert_;
  bool written_ = false;
};

TEST_F(TlsContextsTest, AFullHandshakeBringsTheConfiguredTicketsAndOneResumes) {
  for (uint32_t tickets : {0u, 1u, 2u}) {
    auto tls = contexts("tls13_session_tickets = " + std::to_string(tickets));
    ASSERT_TRUE(tls);
    Outcome full = connect(*tls, nullptr);
    ASSERT_TRUE(full.handshake_done);
    EXPECT_FALSE(full.resumed);
    EXPECT_EQ(full.tickets, static_cast<int>(tickets)) << "after a full handshake";
    if (tickets == 0) {
      EXPECT_EQ(full.session, nullptr);
      continue;
    }
    ASSERT_NE(full.session, nullptr);
    Outcome again = connect(*tls, full.session);
    SSL_SESSION_free(full.session);
    ASSERT_TRUE(again.handshake_done);
    EXPECT_TRUE(again.resumed) << "the ticket resumes";
    EXPECT_EQ(again.tickets, 1) << "a resumed handshake brings one fresh ticket, whatever the setting";
    if (again.session) SSL_SESSION_free(again.session);
  }
  // The default: one.
  auto tls = contexts("");
  ASSERT_TRUE(tls);
  Outcome full = connect(*tls, nullptr);
  ASSERT_TRUE(full.handshake_done);
  EXPECT_EQ(full.tickets, 1);
  if (full.session) SSL_SESSION_free(full.session);
}

// A SIGHUP builds new contexts: with the process's ticket keys passed on, a ticket issued before it resumes
// after it. Contexts with keys of their own (OpenSSL's behaviour, each SSL_CTX its own keys) do not.
TEST_F(TlsContextsTest, ATicketIssuedBeforeAReloadResumesAfterIt) {
  auto keys = TicketKeys::generate();
  ASSERT_TRUE(keys) << keys.message();
  auto before = contexts("", *keys);
  ASSERT_TRUE(before);
  Outcome full = connect(*before, nullptr);
  ASSERT_TRUE(full.handshake_done);
  ASSERT_NE(full.session, nullptr);

  auto reloaded = contexts("", *keys);
  ASSERT_TRUE(reloaded);
  Outcome again = connect(*reloaded, full.session);
  ASSERT_TRUE(again.handshake_done);
  EXPECT_TRUE(again.resumed) << "the reload's contexts read the ticket";
  EXPECT_EQ(again.tickets, 1);
  if (again.session) SSL_SESSION_free(again.session);

  auto other = contexts("");  // keys of its own
  ASSERT_TRUE(other);
  Outcome elsewhere = connect(*other, full.session);
  ASSERT_TRUE(elsewhere.handshake_done) << "an unknown ticket means a full handshake, not a failure";
  EXPECT_FALSE(elsewhere.resumed);
  if (elsewhere.session) SSL_SESSION_free(elsewhere.session);
  SSL_SESSION_free(full.session);
}

// After a rotation, new tickets use the new key and tickets under the kKept - 1 keys before it still resume;
// kKept rotations after its key was made, a ticket no longer does. Each ticket is offered once (a second
// offer of the same TLS 1.3 ticket did not resume here, and RFC 8446 C.4 advises clients to use each once):
// one ticket made before the first rotation for each rotation.
TEST_F(TlsContextsTest, TicketsResumeUntilTheirKeyRotatesOutOfTheRing) {
  auto keys = TicketKeys::generate();
  ASSERT_TRUE(keys) << keys.message();
  auto tls = contexts("", *keys);
  ASSERT_TRUE(tls);
  std::vector<SSL_SESSION*> first_key_tickets;
  for (size_t i = 0; i < TicketKeys::kKept; ++i) {
    Outcome full = connect(*tls, nullptr);
    ASSERT_TRUE(full.handshake_done);
    ASSERT_NE(full.session, nullptr);
    first_key_tickets.push_back(full.session);
  }
  for (size_t rotation = 1; rotation <= TicketKeys::kKept; ++rotation) {
    SCOPED_TRACE("after rotation " + std::to_string(rotation));
    ASSERT_TRUE((*keys)->rotate());
    EXPECT_EQ((*keys)->size(), std::min(rotation + 1, TicketKeys::kKept));
    Outcome again = connect(*tls, first_key_tickets[rotation - 1]);
    ASSERT_TRUE(again.handshake_done);
    EXPECT_EQ(again.resumed, rotation < TicketKeys::kKept);
    EXPECT_EQ(again.tickets, 1) << "a fresh ticket";
    if (again.session) {
      Outcome fresh = connect(*tls, again.session);
      EXPECT_TRUE(fresh.resumed) << "the fresh ticket is under the newest key";
      if (fresh.session) SSL_SESSION_free(fresh.session);
      SSL_SESSION_free(again.session);
    }
  }
  for (SSL_SESSION* s : first_key_tickets) SSL_SESSION_free(s);
}

// TLS 1.2 clients resume with the same keys: a session ticket after the full handshake, the same one kept
// after a resumption under the newest key, a fresh one after a rotation.
TEST_F(TlsContextsTest, ATls12TicketResumesAndIsRenewedOnlyAfterARotation) {
  auto keys = TicketKeys::generate();
  ASSERT_TRUE(keys) << keys.message();
  auto tls = contexts("", *keys);
  ASSERT_TRUE(tls);
  Outcome full = connect(*tls, nullptr, nullptr, TLS1_2_VERSION);
  ASSERT_TRUE(full.handshake_done);
  ASSERT_NE(full.session, nullptr);
  EXPECT_EQ(full.tickets, 1);
  Outcome again = connect(*tls, full.session, nullptr, TLS1_2_VERSION);
  ASSERT_TRUE(again.handshake_done);
  EXPECT_TRUE(again.resumed);
  ASSERT_FALSE(full.ticket.empty());
  EXPECT_EQ(again.ticket, full.ticket) << "the ticket is under the newest key: kept";
  ASSERT_TRUE((*keys)->rotate());
  Outcome rotated = connect(*tls, full.session, nullptr, TLS1_2_VERSION);
  ASSERT_TRUE(rotated.handshake_done);
  EXPECT_TRUE(rotated.resumed);
  EXPECT_FALSE(rotated.ticket.empty());
  EXPECT_NE(rotated.ticket, full.ticket) << "renewed under the new key";
  if (again.session) SSL_SESSION_free(again.session);
  if (rotated.session) SSL_SESSION_free(rotated.session);
  SSL_SESSION_free(full.session);
}

// proxy.tls_ticket_key_file: two proxies (rings of their own) reading the same file resume each other's
// tickets. The rotation the example config describes: a new key added at the end of the other's file still
// resumes the old tickets and issues under the old key; moved to the top it issues under itself, the old
// key still reads; dropped, the old tickets mean a full handshake.
TEST_F(TlsContextsTest, ProxiesReadingOneKeyFileResumeEachOthersTickets) {
  auto line = [] {
    std::string k(80, '\0');
    EXPECT_EQ(RAND_bytes(reinterpret_cast<unsigned char*>(k.data()), 80), 1);
    return base64_encode(k);
  };
  const std::string old_key = line(), new_key = line();
  auto ring_of = [](const std::string& file) {
    auto ring = TicketKeys::generate();
    EXPECT_TRUE(ring);
    auto keys = TicketKeys::parse_key_file(file, "test");
    EXPECT_TRUE(keys) << keys.message();
    (*ring)->use_file_keys(std::move(*keys));
    return *ring;
  };
  // Offers `session` once; whether it resumed (what the handshake issued is freed).
  auto resumes = [](TlsContexts& tls, SSL_SESSION* session) {
    Outcome o = connect(tls, session);
    if (o.session) SSL_SESSION_free(o.session);
    return o.handshake_done && o.resumed;
  };
  auto a_keys = ring_of(old_key + "\n");
  auto b_keys = ring_of(old_key + "\n");
  auto a = contexts("", a_keys);
  auto b = contexts("", b_keys);
  ASSERT_TRUE(a && b);
  Outcome at_a = connect(*a, nullptr);
  ASSERT_TRUE(at_a.handshake_done);
  ASSERT_NE(at_a.session, nullptr);
  Outcome at_b = connect(*b, at_a.session);
  ASSERT_TRUE(at_b.handshake_done);
  EXPECT_TRUE(at_b.resumed) << "B reads A's ticket";
  ASSERT_NE(at_b.session, nullptr);
  EXPECT_TRUE(resumes(*a, at_b.session)) << "and A reads the one B issued";

  Outcome second = connect(*a, nullptr);
  Outcome third = connect(*a, nullptr);
  ASSERT_TRUE(second.session && third.session);
  auto keys = TicketKeys::parse_key_file(old_key + "\n" + new_key + "\n", "test");
  ASSERT_TRUE(keys);
  b_keys->use_file_keys(std::move(*keys));
  Outcome added = connect(*b, second.session);
  EXPECT_TRUE(added.resumed) << "the new key at the end only reads";
  ASSERT_NE(added.session, nullptr);
  EXPECT_TRUE(resumes(*a, added.session)) << "B still issues under the old key, which A has";

  keys = TicketKeys::parse_key_file(new_key + "\n" + old_key + "\n", "test");
  ASSERT_TRUE(keys);
  b_keys->use_file_keys(std::move(*keys));
  Outcome promoted = connect(*b, third.session);
  EXPECT_TRUE(promoted.resumed) << "the old key still reads";
  ASSERT_NE(promoted.session, nullptr);
  EXPECT_FALSE(resumes(*a, promoted.session)) << "B issues under the new key, which A does not have yet";

  keys = TicketKeys::parse_key_file(new_key + "\n", "test");
  ASSERT_TRUE(keys);
  b_keys->use_file_keys(std::move(*keys));
  Outcome dropped = connect(*b, at_a.session);
  EXPECT_TRUE(dropped.handshake_done);
  EXPECT_FALSE(dropped.resumed) << "the old key gone: a full handshake, not a failure";
  for (Outcome* o : {&at_a, &at_b, &second, &third, &added, &promoted, &dropped})
    if (o->session) SSL_SESSION_free(o->session);
}

// A takeover hands the keys to the new process as text: the new process's ring then reads the old one's
// tickets.
TEST_F(TlsContextsTest, KeysHandedOverAsTextReadTheOldProcesssTickets) {
  auto old_keys = TicketKeys::generate();
  auto new_keys = TicketKeys::generate();
  ASSERT_TRUE(old_keys && new_keys);
  ASSERT_TRUE((*old_keys)->rotate());  // two keys, newest first
  auto old_process = contexts("", *old_keys);
  auto new_process = contexts("", *new_keys);
  ASSERT_TRUE(old_process && new_process);
  Outcome full = connect(*old_process, nullptr);
  ASSERT_TRUE(full.handshake_done);
  ASSERT_NE(full.session, nullptr);

  Outcome before = connect(*new_process, full.session);
  EXPECT_FALSE(before.resumed);
  if (before.session) SSL_SESSION_free(before.session);

  ASSERT_TRUE((*new_keys)->replace_with((*old_keys)->serialize()));
  EXPECT_EQ((*new_keys)->size(), 2u);
  Outcome after = connect(*new_process, full.session);
  ASSERT_TRUE(after.handshake_done);
  EXPECT_TRUE(after.resumed) << "the new process reads the old one's ticket";
  if (after.session) SSL_SESSION_free(after.session);
  SSL_SESSION_free(full.session);
}

// A certificate issued by an intermediate (as Let's Encrypt's are) is configured as one file, the leaf and then
// the intermediate (fullchain.pem): the client gets both and trusts the root alone. The proxy never builds a
// chain of its own at each handshake (SSL_MODE_NO_AUTO_CHAIN), so the file's chain is the whole chain.
TEST_F(TlsContextsTest, TheCertificateFilesChainIsSentWhole) {
  test_support::TestCert root("sandgate test root", nullptr, true);
  test_support::TestCert intermediate("sandgate test intermediate", &root, true);
  test_support::TestCert leaf("*.sandbox.localhost", &intermediate, false);
  leaf.write_pem(dir_.path() + "/cert.pem");
  intermediate.append_pem(dir_.path() + "/cert.pem");
  leaf.write_key_pem(dir_.path() + "/key.pem");
  written_ = true;
  auto tls = contexts("");
  ASSERT_TRUE(tls);
  Outcome full = connect(*tls, nullptr, root.cert);
  ASSERT_TRUE(full.handshake_done) << "the client could not verify the chain";
  EXPECT_EQ(full.chain_length, 2) << "the leaf and the intermediate";
  if (full.session) SSL_SESSION_free(full.session);

  // The leaf alone: the client that trusts only the root cannot verify it, and the handshake fails.
  leaf.write_pem(dir_.path() + "/cert.pem");
  auto leaf_only = contexts("");
  ASSERT_TRUE(leaf_only);
  EXPECT_FALSE(connect(*leaf_only, nullptr, root.cert).handshake_done);
}

}  // namespace
}  // namespace sg
