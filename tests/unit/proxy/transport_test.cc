// The transports over real sockets: TcpTransport's results (data, would-block, EOF, error) and splice
// capability, TlsTransport (userspace TLS, no kTLS on this host) against an OpenSSL client over a
// socketpair: reads fill the span across records, close_notify is EOF, shutdown_write sends one, and it
// has no splice capability without kTLS; and what KernelTlsTransport can be checked without kernel TLS
// (the guest test, tests/ktls/, runs it on a kTLS socket): its reads and writes on a socket that delivers
// application data, the alert its shutdown sends, and what each record type the kernel reports means.
#include "proxy/transport.h"

#include <gtest/gtest.h>
#include <openssl/err.h>
#include <sys/socket.h>

#include <algorithm>
#include <string>

#include "common/fd.h"
#include "tests/unit/test_cert.h"

namespace sg {
namespace {

struct Pair {
  UniqueFd a;
  UniqueFd b;
};

Pair socket_pair() {
  int sv[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv), 0);
  return {UniqueFd(sv[0]), UniqueFd(sv[1])};
}

TEST(TcpTransport, ReadWriteEofAndErrors) {
  Pair p = socket_pair();
  TcpTransport t(p.a.get());
  char buf[64];
  EXPECT_EQ(t.read(buf).status, IoResult::Status::kWouldBlock);
  IoResult w = t.write(std::string_view("hello"));
  EXPECT_EQ(w.status, IoResult::Status::kOk);
  EXPECT_EQ(w.bytes, 5u);
  ASSERT_EQ(::send(p.b.get(), "world", 5, MSG_NOSIGNAL), 5);
  IoResult r = t.read(buf);
  EXPECT_EQ(r.status, IoResult::Status::kOk);
  EXPECT_EQ(std::string(buf, r.bytes), "world");
  EXPECT_TRUE(r.drained) << "a short read took all there was: the next would only fail";
  ASSERT_EQ(::send(p.b.get(), "0123456789", 10, MSG_NOSIGNAL), 10);
  char four[4];
  r = t.read(four);
  EXPECT_EQ(r.bytes, 4u);
  EXPECT_FALSE(r.drained) << "stopped for room: more may be there";
  r = t.read(buf);
  EXPECT_EQ(std::string(buf, r.bytes), "456789");
  EXPECT_TRUE(t.shutdown_write());
  char got[8];
  EXPECT_EQ(::recv(p.b.get(), got, sizeof got, 0), 5);
  EXPECT_EQ(::recv(p.b.get(), got, sizeof got, 0), 0) << "FIN";
  p.b.reset();
  EXPECT_EQ(t.read(buf).status, IoResult::Status::kEof);
  IoResult failed = t.write(std::string_view("to nobody"));
  EXPECT_EQ(failed.status, IoResult::Status::kError);
  EXPECT_FALSE(failed.detail.empty());
  EXPECT_FALSE(failed.cause) << "an I/O failure: the connection decides the cause";
  // A plain socket splices both ways from the start.
  EXPECT_TRUE(t.can_splice_out());
  EXPECT_TRUE(t.can_splice_in());
}

TEST(TcpTransport, SplicesThroughAPipe) {
  Pair in = socket_pair();
  Pair out = socket_pair();
  TcpTransport source(in.a.get());
  TcpTransport sink(out.a.get());
  auto pipe = SplicePipe::create(64 * 1024);
  ASSERT_TRUE(pipe);
  ASSERT_EQ(::send(in.b.get(), "spliced", 7, MSG_NOSIGNAL), 7);
  IoResult r = source.splice_in(**pipe);
  EXPECT_EQ(r.status, IoResult::Status::kOk);
  EXPECT_EQ(r.bytes, 7u);
  EXPECT_EQ(sink.splice_out(**pipe).bytes, 7u);
  char got[16];
  EXPECT_EQ(std::string(got, static_cast<size_t>(::recv(out.b.get(), got, sizeof got, 0))), "spliced");
  EXPECT_EQ(source.splice_in(**pipe).status, IoResult::Status::kWouldBlock);
  in.b.reset();
  EXPECT_EQ(source.splice_in(**pipe).status, IoResult::Status::kEof);
}

class TlsTransportTest : public ::testing::Test {
 public:
  void SetUp() override {
    server_ctx_ = SSL_CTX_new(TLS_server_method());
    if (read_ahead_) SSL_CTX_set_read_ahead(server_ctx_, 1);  // as the proxy's contexts without kTLS
    SSL_CTX_use_certificate(server_ctx_, cert_.cert);
    SSL_CTX_use_PrivateKey(server_ctx_, cert_.key);
    enable_tls13_secret_tracking(server_ctx_);  // as the proxy's contexts
    client_ctx_ = SSL_CTX_new(TLS_client_method());
    if (client_max_version_) SSL_CTX_set_max_proto_version(client_ctx_, client_max_version_);
    SSL* server = SSL_new(server_ctx_);
    SSL_set_fd(server, pair_.a.get());
    SSL_set_accept_state(server);
    transport_ = std::make_unique<TlsTransport>(server, pair_.a.get(), std::make_unique<Tls13SecretTracker>(),
                                                may_leave_openssl_);
    client_ = SSL_new(client_ctx_);
    SSL_set_fd(client_, pair_.b.get());
    SSL_set_connect_state(client_);
    // Both ends are non-blocking: step them in turn until both are done.
    bool server_done = false;
    bool client_done = false;
    for (int i = 0; i < 100 && !(server_done && client_done); ++i) {
      if (!server_done && SSL_do_handshake(server) == 1) {
        server_done = true;
        transport_->handshake_finished();
      }
      if (!client_done) client_done = SSL_do_handshake(client_) == 1;
    }
    ASSERT_TRUE(server_done && client_done);
    transport_->plan_ktls();
  }
  void TearDown() override {
    transport_.reset();
    SSL_free(client_);
    SSL_CTX_free(client_ctx_);
    SSL_CTX_free(server_ctx_);
  }

  // The client's side: sends (a non-blocking write of a few KiB into an empty socket buffer completes).
  void client_sends(std::string_view data) {
    ASSERT_EQ(SSL_write(client_, data.data(), static_cast<int>(data.size())), static_cast<int>(data.size()));
  }
  std::string client_reads() {
    std::string got;
    char buf[4096];
    int n;
    while ((n = SSL_read(client_, buf, sizeof buf)) > 0) got.append(buf, static_cast<size_t>(n));
    return got;
  }

  // Everything the transport has for the reader, until it would block (or `want` bytes came).
  std::string server_reads(size_t want = SIZE_MAX) {
    std::string got;
    char buf[5000];  // less than a full record: some are decrypted in place and handed out in parts
    for (int i = 0; i < 10000 && got.size() < want; ++i) {
      IoResult r = transport_->read(buf);
      got.append(buf, r.bytes);
      if (r.status == IoResult::Status::kError || r.status == IoResult::Status::kEof) break;
      if (r.status == IoResult::Status::kWouldBlock && want == SIZE_MAX) break;
    }
    return got;
  }
  // Writes all of `data` through the transport while the client reads; returns what the client got.
  std::string send_to_client(const std::string& data) {
    std::string got;
    size_t written = 0;
    char buf[16384];
    for (int i = 0; i < 100000 && got.size() < data.size(); ++i) {
      if (written < data.size()) {
        IoResult w = transport_->write(std::string_view(data).substr(written));
        EXPECT_NE(w.status, IoResult::Status::kError) << w.detail;
        if (w.status == IoResult::Status::kError) break;
        written += w.bytes;
      }
      int n = SSL_read(client_, buf, sizeof buf);
      if (n > 0) got.append(buf, static_cast<size_t>(n));
    }
    return got;
  }

  bool read_ahead_ = false;
  bool may_leave_openssl_ = true;
  int client_max_version_ = 0;
  test_support::TestCert cert_;
  Pair pair_ = socket_pair();
  SSL_CTX* server_ctx_ = nullptr;
  SSL_CTX* client_ctx_ = nullptr;
  SSL* client_ = nullptr;
  std::unique_ptr<TlsTransport> transport_;
};

TEST_F(TlsTransportTest, ReadsAcrossRecordsUntilTheSocketIsDry) {
  client_sends("one record, ");
  client_sends("and another");
  char buf[256];
  IoResult r = transport_->read(buf);
  EXPECT_EQ(r.status, IoResult::Status::kWouldBlock) << "dry after both records";
  EXPECT_EQ(std::string(buf, r.bytes), "one record, and another");
  // A span smaller than what came: full, the rest stays inside OpenSSL (poll cannot see it).
  client_sends("0123456789");
  char small[4];
  r = transport_->read(small);
  EXPECT_EQ(r.status, IoResult::Status::kOk);
  EXPECT_EQ(std::string(small, r.bytes), "0123");
  EXPECT_TRUE(transport_->has_buffered_input());
}

// An error some other OpenSSL call left on this thread's queue must not make a read or a write look failed
// (SSL_get_error reads the queue): it is cleared first, and an empty queue is left alone.
TEST_F(TlsTransportTest, AStaleErrorOnTheThreadDoesNotFailAReadOrAWrite) {
  char buf[64];
  for (int i = 0; i < 2; ++i) {
    ERR_raise(ERR_LIB_SSL, SSL_R_BAD_LENGTH);
    ASSERT_NE(ERR_peek_error(), 0u);
    IoResult r = transport_->read(buf);
    EXPECT_EQ(r.status, IoResult::Status::kWouldBlock) << r.detail;
    ERR_raise(ERR_LIB_SSL, SSL_R_BAD_LENGTH);
    r = transport_->write(std::string_view("pong"));
    EXPECT_EQ(r.status, IoResult::Status::kOk) << r.detail;
  }
  EXPECT_EQ(ERR_peek_error(), 0u);
  EXPECT_EQ(client_reads(), "pongpong");
}

class TlsTransportReadAheadTest : public TlsTransportTest {
 protected:
  TlsTransportReadAheadTest() { read_ahead_ = true; }
};

// With read-ahead, what one read() brought in is decrypted whole: the read stops there instead of calling
// read() again for an EAGAIN, and says the socket is dry.
TEST_F(TlsTransportReadAheadTest, StopsWhenOpenSslsBufferIsEmptyAndSaysTheSocketIsDry) {
  client_sends("one record, ");
  client_sends("and another");
  char buf[256];
  IoResult r = transport_->read(buf);
  EXPECT_EQ(r.status, IoResult::Status::kOk);
  EXPECT_TRUE(r.drained);
  EXPECT_EQ(std::string(buf, r.bytes), "one record, and another");
  EXPECT_FALSE(transport_->has_buffered_input());
  r = transport_->read(buf);
  EXPECT_EQ(r.status, IoResult::Status::kWouldBlock) << "it was dry";
  EXPECT_EQ(r.bytes, 0u);
  // Stopped for room: not dry, and the rest is inside OpenSSL.
  client_sends("0123456789");
  char small[4];
  r = transport_->read(small);
  EXPECT_EQ(r.status, IoResult::Status::kOk);
  EXPECT_FALSE(r.drained);
  EXPECT_TRUE(transport_->has_buffered_input());
}

TEST_F(TlsTransportTest, WritesAndShutsDownWithCloseNotify) {
  IoResult w = transport_->write(std::string_view("to the client"));
  EXPECT_EQ(w.status, IoResult::Status::kOk);
  EXPECT_TRUE(transport_->shutdown_write());
  EXPECT_EQ(client_reads(), "to the client");
  EXPECT_EQ(SSL_get_error(client_, 0), SSL_ERROR_ZERO_RETURN) << "close_notify";
}

TEST_F(TlsTransportTest, CloseNotifyIsEofWithTheBytesBeforeIt) {
  client_sends("last words");
  SSL_shutdown(client_);
  char buf[256];
  IoResult r = transport_->read(buf);
  EXPECT_EQ(r.status, IoResult::Status::kEof);
  EXPECT_EQ(std::string(buf, r.bytes), "last words") << "the bytes before close_notify come with it";
}

TEST_F(TlsTransportTest, ABrokenRecordIsAnError) {
  ASSERT_EQ(::send(pair_.b.get(), "\x17\x03\x03\x00\x05hello", 10, MSG_NOSIGNAL), 10);
  char buf[256];
  IoResult r = transport_->read(buf);
  EXPECT_EQ(r.status, IoResult::Status::kError);
  EXPECT_FALSE(r.detail.empty());
}

TEST_F(TlsTransportTest, NoSpliceWithoutKtlsAndReceiveStaysWithOpenSsl) {
  EXPECT_FALSE(transport_->ktls_tx());
  EXPECT_FALSE(transport_->can_splice_out());
  EXPECT_FALSE(transport_->can_splice_in());
  Status handed = transport_->hand_receive_to_kernel();
  EXPECT_FALSE(handed);
  EXPECT_EQ(handed.error(), Error::kUnsupported) << handed.message();
  // Refused, it changed nothing: OpenSSL still reads.
  client_sends("still OpenSSL's");
  char buf[64];
  IoResult r = transport_->read(buf);
  EXPECT_EQ(std::string(buf, r.bytes), "still OpenSSL's");
}

// ---- A TLS 1.3 connection leaves OpenSSL for the proxy's own record layer ----

std::string pattern(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>('a' + (i * 7 + i / 251) % 26);
  return s;
}

// Traffic both ways with OpenSSL (tickets, requests, answers: the sequence numbers move), the switch, then
// records of every size both ways, a socket that fills up, and the end of both streams.
void goes_on_after_the_switch(TlsTransportTest& t, SSL* client, TlsTransport& transport) {
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(SSL_write(client, "request", 7), 7);
    EXPECT_EQ(t.server_reads(7), "request");
    EXPECT_EQ(t.send_to_client("answer"), "answer");
  }
  transport.release_memory_while_idle();
  ASSERT_TRUE(transport.own_records());
  EXPECT_EQ(transport.ssl(), nullptr) << "the SSL is freed";

  ASSERT_EQ(SSL_write(client, "after", 5), 5);
  EXPECT_EQ(t.server_reads(5), "after");
  EXPECT_EQ(t.send_to_client("reply"), "reply");
  // An upload of several full records (one read() takes many), with the reader's room smaller than a record.
  const std::string upload = pattern(100 * 1024 + 17);
  size_t sent = 0;
  std::string got;
  for (int i = 0; i < 10000 && (sent < upload.size() || got.size() < upload.size()); ++i) {
    if (sent < upload.size()) {
      int n = SSL_write(client, upload.data() + sent, static_cast<int>(std::min<size_t>(upload.size() - sent, 30000)));
      if (n > 0) sent += static_cast<size_t>(n);
    }
    std::string part = t.server_reads();
    ASSERT_TRUE(part.size() > 0 || sent < upload.size() || got.size() == upload.size()) << "stalled at " << got.size();
    got += part;
  }
  EXPECT_EQ(got, upload);
  // A download larger than the socket's buffer: writes that would block resume with the same bytes.
  const std::string download = pattern(600 * 1024 + 3);
  EXPECT_EQ(t.send_to_client(download), download);
  // The memory goes while quiet and comes back with the next bytes.
  transport.release_memory_while_idle();
  ASSERT_EQ(SSL_write(client, "again", 5), 5);
  EXPECT_EQ(t.server_reads(5), "again");
  EXPECT_EQ(t.send_to_client("still"), "still");

  EXPECT_TRUE(transport.shutdown_write());
  char buf[16];
  EXPECT_LE(SSL_read(client, buf, sizeof buf), 0);
  EXPECT_EQ(SSL_get_error(client, 0), SSL_ERROR_ZERO_RETURN) << "close_notify";
  ASSERT_EQ(SSL_write(client, "bye", 3), 3);
  SSL_shutdown(client);
  char tail[16];
  IoResult r = transport.read(tail);
  EXPECT_EQ(r.status, IoResult::Status::kEof);
  EXPECT_EQ(std::string(tail, r.bytes), "bye");
}

TEST_F(TlsTransportTest, AQuietTls13ConnectionLeavesOpenSslAndGoesOnBothWays) {
  goes_on_after_the_switch(*this, client_, *transport_);
}

TEST_F(TlsTransportReadAheadTest, AQuietTls13ConnectionLeavesOpenSslAndGoesOnBothWays) {
  goes_on_after_the_switch(*this, client_, *transport_);
}

// With read-ahead (contexts without kTLS) a read that leaves OpenSSL's buffer empty is a record boundary:
// the switch is made at the second, before the connection has been quiet; a connection that carries one
// request and closes never makes it. Without read-ahead, only when quiet.
TEST_F(TlsTransportReadAheadTest, TheSecondReadThatEmptiesOpenSslsBufferLeavesOpenSsl) {
  client_sends("request");
  char small[4];
  IoResult r = transport_->read(small);
  EXPECT_EQ(std::string(small, r.bytes), "requ");
  EXPECT_FALSE(transport_->own_records()) << "OpenSSL still holds the rest";
  EXPECT_EQ(server_reads(3), "est");
  EXPECT_FALSE(transport_->own_records()) << "one request so far";
  EXPECT_EQ(send_to_client("answer"), "answer");
  client_sends("second");
  EXPECT_EQ(server_reads(6), "second");
  EXPECT_TRUE(transport_->own_records());
  EXPECT_EQ(send_to_client("answer"), "answer");
}

TEST_F(TlsTransportReadAheadTest, AConnectionWithOneRequestEndsWithoutLeavingOpenSsl) {
  client_sends("request");
  EXPECT_EQ(server_reads(7), "request");
  EXPECT_EQ(send_to_client("answer"), "answer");
  SSL_shutdown(client_);
  char buf[16];
  IoResult r = transport_->read(buf);
  EXPECT_EQ(r.status, IoResult::Status::kEof);
  EXPECT_FALSE(transport_->own_records());
  EXPECT_TRUE(transport_->shutdown_write());
}

// A long answer to one request (a download, server-sent events) brings no second read: past 64 KiB out the
// switch is made at a write, and the rest goes out through the own layer.
TEST_F(TlsTransportReadAheadTest, ALongAnswerToOneRequestLeavesOpenSslPast64KiB) {
  client_sends("request");
  EXPECT_EQ(server_reads(7), "request");
  EXPECT_EQ(send_to_client(pattern(60 * 1024)), pattern(60 * 1024));
  EXPECT_FALSE(transport_->own_records()) << "a short answer stays with OpenSSL";
  // The answer goes on in pieces, as the forwarder writes what it read from the sandbox.
  const std::string piece = pattern(64 * 1024 + 5);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(send_to_client(piece), piece) << i;
  EXPECT_TRUE(transport_->own_records());
  client_sends("next");
  EXPECT_EQ(server_reads(4), "next");
}

TEST_F(TlsTransportTest, WithoutReadAheadTheSwitchWaitsUntilTheConnectionIsQuiet) {
  client_sends("request");
  EXPECT_EQ(server_reads(7), "request");
  EXPECT_FALSE(transport_->own_records());
  transport_->release_memory_while_idle();
  EXPECT_TRUE(transport_->own_records());
}

class TlsTransportOpenSslOnlyTest : public TlsTransportTest {
 protected:
  TlsTransportOpenSslOnlyTest() {
    read_ahead_ = true;
    may_leave_openssl_ = false;  // proxy.tls_own_record_layer = false
  }
};

TEST_F(TlsTransportOpenSslOnlyTest, TheRecordsStayWithOpenSslWhenTheOwnLayerIsOff) {
  client_sends("request");
  EXPECT_EQ(server_reads(7), "request");
  transport_->release_memory_while_idle();
  EXPECT_FALSE(transport_->own_records());
  EXPECT_NE(transport_->ssl(), nullptr);
  EXPECT_EQ(send_to_client("answer"), "answer");
}

TEST_F(TlsTransportTest, AKeyUpdateFromTheClientIsFollowedBothWaysAfterTheSwitch) {
  transport_->release_memory_while_idle();
  ASSERT_TRUE(transport_->own_records());
  // The client counts the KeyUpdates it receives.
  static int updates_received = 0;
  updates_received = 0;
  SSL_set_msg_callback(client_, [](int write_p, int, int type, const void* buf, size_t len, SSL*, void*) {
    if (!write_p && type == SSL3_RT_HANDSHAKE && len >= 1 && *static_cast<const unsigned char*>(buf) == SSL3_MT_KEY_UPDATE)
      ++updates_received;
  });
  int asked = 0;
  for (int type : {SSL_KEY_UPDATE_REQUESTED, SSL_KEY_UPDATE_NOT_REQUESTED, SSL_KEY_UPDATE_REQUESTED}) {
    ASSERT_EQ(SSL_key_update(client_, type), 1);
    client_sends("under the next key");  // the KeyUpdate goes first
    EXPECT_EQ(server_reads(18), "under the next key");
    // When asked, ours goes before the answer, and the answer is under the key that follows it.
    EXPECT_EQ(send_to_client("answer"), "answer");
    if (type == SSL_KEY_UPDATE_REQUESTED) ++asked;
    EXPECT_EQ(updates_received, asked);
  }
}

// Records that carry nothing end no read: 32 in a row are taken (OpenSSL's and BoringSSL's limit), the 33rd
// ends the connection, so a client cannot keep a worker decrypting KeyUpdates.
TEST_F(TlsTransportTest, ARunOfRecordsThatCarryNothingIsCutShort) {
  transport_->release_memory_while_idle();
  ASSERT_TRUE(transport_->own_records());
  auto key_updates = [&](int n) {
    for (int i = 0; i < n; ++i) {
      ASSERT_EQ(SSL_key_update(client_, SSL_KEY_UPDATE_NOT_REQUESTED), 1);
      ASSERT_EQ(SSL_do_handshake(client_), 1);
    }
  };
  key_updates(32);
  client_sends("x");
  EXPECT_EQ(server_reads(1), "x") << "32 in a row, then data, is fine";
  key_updates(33);
  char buf[16];
  IoResult r = transport_->read(buf);
  EXPECT_EQ(r.status, IoResult::Status::kError);
  EXPECT_NE(r.detail.find("too many"), std::string::npos) << r.detail;
}

// A record whose header OpenSSL has read and whose body has not come: the socket's next byte is inside it,
// so the switch waits for the body.
TEST_F(TlsTransportTest, NoSwitchWhileOpenSslHasReadARecordsHeaderAlone) {
  client_sends("split record");
  char record[256];
  ssize_t n = ::recv(pair_.a.get(), record, sizeof record, 0);  // taken off the server's socket
  ASSERT_GT(n, 5);
  ASSERT_EQ(::send(pair_.b.get(), record, 5, MSG_NOSIGNAL), 5);  // and put back: the header alone
  char buf[64];
  IoResult r = transport_->read(buf);
  EXPECT_EQ(r.status, IoResult::Status::kWouldBlock);
  transport_->release_memory_while_idle();
  EXPECT_FALSE(transport_->own_records()) << "the switch would have lost the record's place";
  ASSERT_EQ(::send(pair_.b.get(), record + 5, static_cast<size_t>(n) - 5, MSG_NOSIGNAL), n - 5);
  EXPECT_EQ(server_reads(12), "split record");
  transport_->release_memory_while_idle();
  EXPECT_TRUE(transport_->own_records());
  client_sends("after");
  EXPECT_EQ(server_reads(5), "after");
}

TEST_F(TlsTransportTest, PaddedRecordsAreReadWithoutTheirPadding) {
  transport_->release_memory_while_idle();
  ASSERT_TRUE(transport_->own_records());
  SSL_set_block_padding(client_, 512);
  client_sends("padded to 512 bytes");
  client_sends("and another");
  EXPECT_EQ(server_reads(30), "padded to 512 bytesand another");
}

TEST_F(TlsTransportTest, ARecordThatDoesNotAuthenticateAfterTheSwitchIsAnError) {
  transport_->release_memory_while_idle();
  ASSERT_TRUE(transport_->own_records());
  std::string forged = std::string("\x17\x03\x03\x00\x20", 5) + std::string(32, 'x');
  ASSERT_EQ(::send(pair_.b.get(), forged.data(), forged.size(), MSG_NOSIGNAL), static_cast<ssize_t>(forged.size()));
  char buf[64];
  IoResult r = transport_->read(buf);
  EXPECT_EQ(r.status, IoResult::Status::kError);
  EXPECT_NE(r.detail.find("bad_record_mac"), std::string::npos) << r.detail;
}

TEST_F(TlsTransportTest, ATooLongOrTooShortRecordAfterTheSwitchIsAnError) {
  for (std::string header : {std::string("\x17\x03\x03\x41\x01", 5), std::string("\x17\x03\x03\x00\x05", 5),
                             std::string("\x16\x03\x03\x00\x20", 5)}) {
    TearDown();
    pair_ = socket_pair();
    SetUp();
    transport_->release_memory_while_idle();
    ASSERT_TRUE(transport_->own_records());
    ASSERT_EQ(::send(pair_.b.get(), header.data(), header.size(), MSG_NOSIGNAL), 5);
    char buf[64];
    IoResult r = transport_->read(buf);
    EXPECT_EQ(r.status, IoResult::Status::kError) << "header type " << int(header[0]) << " length " << int(header[3]);
    EXPECT_FALSE(r.detail.empty());
  }
}

class TlsTransportTls12Test : public TlsTransportTest {
 protected:
  TlsTransportTls12Test() { client_max_version_ = TLS1_2_VERSION; }
};

TEST_F(TlsTransportTls12Test, ATls12ConnectionStaysWithOpenSsl) {
  transport_->release_memory_while_idle();
  EXPECT_FALSE(transport_->own_records());
  client_sends("tls 1.2");
  EXPECT_EQ(server_reads(7), "tls 1.2");
  EXPECT_EQ(send_to_client("answer"), "answer");
}

TEST_F(TlsTransportTest, AKeyUpdateBeforeTheSwitchKeepsTheConnectionWithOpenSsl) {
  ASSERT_EQ(SSL_key_update(client_, SSL_KEY_UPDATE_NOT_REQUESTED), 1);
  client_sends("moved on");
  EXPECT_EQ(server_reads(8), "moved on");
  transport_->release_memory_while_idle();
  EXPECT_FALSE(transport_->own_records()) << "the tracker's key is the old one";
  client_sends("still fine");
  EXPECT_EQ(server_reads(10), "still fine");
  EXPECT_EQ(send_to_client("answer"), "answer");
}

TEST_F(TlsTransportTest, ConnectionsWithAWriteOpenSslCouldNotFinishStayWithIt) {
  // Fill the socket until OpenSSL keeps part of a record.
  const std::string chunk = pattern(64 * 1024);
  IoResult w;
  for (int i = 0; i < 1000; ++i) {
    w = transport_->write(chunk);
    if (w.status == IoResult::Status::kWouldBlock) break;
  }
  ASSERT_EQ(w.status, IoResult::Status::kWouldBlock);
  transport_->release_memory_while_idle();
  EXPECT_FALSE(transport_->own_records());
}

// The switch to the kernel frees the SSL of a connection that goes on: its TLS 1.2 session must stay in the
// context's cache for a session-ID resumption, which OpenSSL prevents for an SSL freed unshut.
TEST(TlsTransportSession, ATls12SessionStaysResumableWhenTheSslIsFreedForTheKernel) {
  test_support::TestCert cert;
  SSL_CTX* server_ctx = SSL_CTX_new(TLS_server_method());
  SSL_CTX_use_certificate(server_ctx, cert.cert);
  SSL_CTX_use_PrivateKey(server_ctx, cert.key);
  SSL_CTX_set_options(server_ctx, SSL_OP_NO_TICKET);  // resumption by session ID, from the server's cache
  SSL_CTX_set_max_proto_version(server_ctx, TLS1_2_VERSION);
  SSL_CTX* client_ctx = SSL_CTX_new(TLS_client_method());
  // One handshake through a TlsTransport, freed as the switch frees it (kept) or as a connection cut short
  // is; returns whether it resumed and the client's session.
  auto connect = [&](SSL_SESSION* offer, bool keep) {
    Pair p = socket_pair();
    SSL* server = SSL_new(server_ctx);
    SSL_set_fd(server, p.a.get());
    SSL_set_accept_state(server);
    auto transport = std::make_unique<TlsTransport>(server, p.a.get(), nullptr);
    SSL* client = SSL_new(client_ctx);
    SSL_set_fd(client, p.b.get());
    SSL_set_connect_state(client);
    if (offer) SSL_set_session(client, offer);
    bool server_done = false, client_done = false;
    for (int i = 0; i < 100 && !(server_done && client_done); ++i) {
      if (!server_done) server_done = SSL_do_handshake(server) == 1;
      if (!client_done) client_done = SSL_do_handshake(client) == 1;
    }
    EXPECT_TRUE(server_done && client_done);
    const bool resumed = SSL_session_reused(server) == 1;
    if (keep) transport->keep_session_when_freed();
    transport.reset();
    SSL_SESSION* session = SSL_get1_session(client);
    SSL_set_shutdown(client, SSL_SENT_SHUTDOWN | SSL_RECEIVED_SHUTDOWN);  // the client's session stays resumable
    SSL_free(client);
    return std::make_pair(resumed, session);
  };
  auto [first_resumed, kept] = connect(nullptr, true);
  EXPECT_FALSE(first_resumed);
  auto [resumed, second] = connect(kept, false);
  EXPECT_TRUE(resumed) << "the session outlived the SSL freed for the kernel";
  // The same without keep_session_when_freed: the second connection's SSL was freed unshut, so its session
  // (the one resumed) left the cache.
  auto [resumed_again, third] = connect(second, true);
  EXPECT_FALSE(resumed_again) << "OpenSSL drops the session of an SSL freed unshut";
  SSL_SESSION_free(kept);
  SSL_SESSION_free(second);
  SSL_SESSION_free(third);
  SSL_CTX_free(client_ctx);
  SSL_CTX_free(server_ctx);
}

TEST(KernelTlsTransport, ReadsAndWritesASocketWhoseRecordsAreData) {
  Pair p = socket_pair();
  KernelTlsTransport t(p.a.get());
  EXPECT_TRUE(t.can_splice_out());
  EXPECT_TRUE(t.can_splice_in());
  char buf[256];
  EXPECT_EQ(t.read(buf).status, IoResult::Status::kWouldBlock);
  ASSERT_EQ(::send(p.b.get(), "request", 7, MSG_NOSIGNAL), 7);
  IoResult r = t.read(buf);
  EXPECT_EQ(r.status, IoResult::Status::kOk);
  EXPECT_EQ(std::string(buf, r.bytes), "request");
  EXPECT_TRUE(r.drained) << "a short read took all there was";
  IoResult w = t.write(std::string_view("response"));
  EXPECT_EQ(w.bytes, 8u);
  char got[16];
  EXPECT_EQ(std::string(got, static_cast<size_t>(::recv(p.b.get(), got, sizeof got, 0))), "response");
  p.b.reset();
  EXPECT_EQ(t.read(buf).status, IoResult::Status::kEof) << "a FIN without close_notify still ends the input";
  EXPECT_EQ(t.write(std::string_view("to nobody")).status, IoResult::Status::kError);
}

// On kTLS an empty application-data record splices as 0 bytes, like the end of the stream: a splice that
// moves nothing is not taken for EOF but handed to read() (kNotData), which waits past an empty record and
// returns EOF only at the end. Here, without kernel TLS, the FIN is what splices as 0.
TEST(KernelTlsTransport, ASpliceThatMovesNothingIsConfirmedByARead) {
  Pair p = socket_pair();
  KernelTlsTransport t(p.a.get());
  auto pipe = SplicePipe::create(64 * 1024);
  ASSERT_TRUE(pipe);
  EXPECT_EQ(t.splice_in(**pipe).status, IoResult::Status::kWouldBlock);
  ASSERT_EQ(::send(p.b.get(), "data", 4, MSG_NOSIGNAL), 4);
  EXPECT_EQ(t.splice_in(**pipe).bytes, 4u);
  p.b.reset();
  EXPECT_EQ(t.splice_in(**pipe).status, IoResult::Status::kNotData) << "zero is not EOF by itself on kTLS";
  char buf[256];
  EXPECT_EQ(t.read(buf).status, IoResult::Status::kEof) << "the read says it is";
  TcpTransport plain(p.a.get());
  EXPECT_EQ(plain.splice_in(**pipe).status, IoResult::Status::kEof) << "a TCP socket's zero is EOF";
}

// A reader whose buffer is nearly full reads through a small buffer of the transport's (a control record
// must come whole): data still arrives, as much as fits, and the rest waits there, where poll cannot see
// it (has_buffered_input), ahead of what the socket holds.
TEST(KernelTlsTransport, AReaderWithLittleRoomGetsWhatFitsAndTheRestNext) {
  Pair p = socket_pair();
  KernelTlsTransport t(p.a.get());
  ASSERT_EQ(::send(p.b.get(), "0123456789", 10, MSG_NOSIGNAL), 10);
  char four[4];
  IoResult r = t.read(four);
  EXPECT_EQ(r.status, IoResult::Status::kOk);
  EXPECT_EQ(std::string(four, r.bytes), "0123");
  EXPECT_FALSE(r.drained) << "stopped for room";
  EXPECT_TRUE(t.has_buffered_input());
  ASSERT_EQ(::send(p.b.get(), "abc", 3, MSG_NOSIGNAL), 3);
  char three[3];
  r = t.read(three);
  EXPECT_EQ(std::string(three, r.bytes), "456");
  char rest[256];
  r = t.read(rest);
  EXPECT_EQ(std::string(rest, r.bytes), "789") << "what was held comes before the socket's next bytes";
  EXPECT_FALSE(t.has_buffered_input());
  r = t.read(rest);
  EXPECT_EQ(std::string(rest, r.bytes), "abc");
  EXPECT_TRUE(r.drained);
}

// On a kTLS socket the kernel encrypts the two bytes into an alert record; here they arrive as they are.
TEST(KernelTlsTransport, ShutdownSendsAWarningCloseNotifyThenFin) {
  Pair p = socket_pair();
  KernelTlsTransport t(p.a.get());
  EXPECT_TRUE(t.shutdown_write());
  char got[8];
  ASSERT_EQ(::recv(p.b.get(), got, sizeof got, 0), 2);
  EXPECT_EQ(got[0], SSL3_AL_WARNING);
  EXPECT_EQ(got[1], SSL_AD_CLOSE_NOTIFY);
  EXPECT_EQ(::recv(p.b.get(), got, sizeof got, 0), 0) << "FIN";
}

TEST(KernelTlsTransport, EachRecordTypeTheKernelReportsHasItsMeaning) {
  auto result = [](uint8_t type, std::string_view record) {
    return kernel_tls_record_result(type, record.data(), record.size());
  };
  IoResult data = result(SSL3_RT_APPLICATION_DATA, "GET / HTTP/1.1\r\n");
  EXPECT_EQ(data.status, IoResult::Status::kOk);
  EXPECT_EQ(data.bytes, 16u);

  const char close_notify[] = {SSL3_AL_WARNING, SSL_AD_CLOSE_NOTIFY};
  EXPECT_EQ(result(SSL3_RT_ALERT, std::string_view(close_notify, 2)).status, IoResult::Status::kEof);
  const char user_canceled[] = {SSL3_AL_WARNING, SSL_AD_USER_CANCELLED};
  EXPECT_EQ(result(SSL3_RT_ALERT, std::string_view(user_canceled, 2)).status, IoResult::Status::kWouldBlock)
      << "a close_notify follows it";

  const char fatal[] = {SSL3_AL_FATAL, SSL_AD_HANDSHAKE_FAILURE};
  IoResult alert = result(SSL3_RT_ALERT, std::string_view(fatal, 2));
  EXPECT_EQ(alert.status, IoResult::Status::kError);
  EXPECT_EQ(alert.cause, TerminationCause::kClientClosed) << "the client ended it";
  EXPECT_NE(alert.detail.find("handshake failure"), std::string::npos) << alert.detail;

  const char key_update[] = {SSL3_MT_KEY_UPDATE, 0, 0, 1, 0};
  IoResult rekey = result(SSL3_RT_HANDSHAKE, std::string_view(key_update, sizeof key_update));
  EXPECT_EQ(rekey.status, IoResult::Status::kError);
  EXPECT_EQ(rekey.cause, TerminationCause::kKtlsKeyUpdate);

  // Anything else ends the connection as an error of its own; short records too, without reading past them.
  const char client_hello[] = {SSL3_MT_CLIENT_HELLO, 0, 0, 0};
  for (auto [type, record] : std::initializer_list<std::pair<uint8_t, std::string_view>>{
           {SSL3_RT_HANDSHAKE, std::string_view(client_hello, sizeof client_hello)},
           {SSL3_RT_HANDSHAKE, {}},
           {SSL3_RT_ALERT, std::string_view(fatal, 1)},
           {SSL3_RT_CHANGE_CIPHER_SPEC, "\x01"},
           {99, "?"}}) {
    IoResult other = result(type, record);
    EXPECT_EQ(other.status, IoResult::Status::kError) << int{type} << " " << record.size();
    EXPECT_NE(other.cause, TerminationCause::kKtlsKeyUpdate);
    EXPECT_FALSE(other.detail.empty());
  }
}

}  // namespace
}  // namespace sg
