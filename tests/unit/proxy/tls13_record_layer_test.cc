// The record layer on its own: two of them face each other over a socketpair with their secrets swapped
// (one's client secret is the other's server secret), so each reads what the other writes. What a real
// OpenSSL client makes of it is in transport_test.cc (TlsTransport after the switch).
#include "proxy/tls13_record_layer.h"

#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <sys/socket.h>

#include <string>

#include "common/fd.h"

namespace sg {
namespace {

struct Peers {
  UniqueFd a_fd;
  UniqueFd b_fd;
  std::unique_ptr<Tls13RecordLayer> a;  // writes with secret Y, reads with X
  std::unique_ptr<Tls13RecordLayer> b;  // writes with X, reads with Y
};

Peers make_peers(uint16_t suite, const EVP_MD* digest, uint64_t a_to_b_seq = 0) {
  int sv[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv), 0);
  const size_t len = static_cast<size_t>(EVP_MD_get_size(digest));
  std::vector<unsigned char> x(len, 0x11), y(len, 0x22);
  auto a = Tls13RecordLayer::create({suite, digest, x, 0, y, a_to_b_seq});
  auto b = Tls13RecordLayer::create({suite, digest, y, a_to_b_seq, x, 0});
  EXPECT_TRUE(a && b);
  return {UniqueFd(sv[0]), UniqueFd(sv[1]), std::move(*a), std::move(*b)};
}

std::string read_all(Tls13RecordLayer& layer, int fd, size_t want, size_t room = 4096) {
  std::string got;
  std::vector<char> buf(room);
  for (int i = 0; i < 1000 && got.size() < want; ++i) {
    IoResult r = layer.read(fd, buf);
    got.append(buf.data(), r.bytes);
    if (r.status == IoResult::Status::kError || r.status == IoResult::Status::kEof) break;
  }
  return got;
}

TEST(Tls13RecordLayer, EachSuiteCarriesDataBothWays) {
  struct Suite {
    uint16_t id;
    const EVP_MD* digest;
  };
  for (Suite s : {Suite{0x1301, EVP_sha256()}, Suite{0x1302, EVP_sha384()}, Suite{0x1303, EVP_sha256()}}) {
    Peers p = make_peers(s.id, s.digest);
    IoResult w = p.a->write(p.a_fd.get(), std::string_view("from a"));
    ASSERT_EQ(w.status, IoResult::Status::kOk) << w.detail;
    EXPECT_EQ(w.bytes, 6u);
    EXPECT_EQ(read_all(*p.b, p.b_fd.get(), 6), "from a") << std::hex << s.id;
    ASSERT_EQ(p.b->write(p.b_fd.get(), std::string_view("from b")).status, IoResult::Status::kOk);
    EXPECT_EQ(read_all(*p.a, p.a_fd.get(), 6), "from b");
  }
}

TEST(Tls13RecordLayer, ASuiteItDoesNotHaveOrASecretOfTheWrongLengthIsRefused) {
  std::vector<unsigned char> secret(32, 1);
  auto r = Tls13RecordLayer::create({0x1304, EVP_sha256(), secret, 0, secret, 0});  // AES-128-CCM
  EXPECT_FALSE(r);
  EXPECT_EQ(r.error(), Error::kUnsupported);
  auto wrong = Tls13RecordLayer::create({0x1302, EVP_sha384(), secret, 0, secret, 0});
  EXPECT_FALSE(wrong);
}

// After 2^23 records its key moves on by itself: a KeyUpdate, then records under the next key.
TEST(Tls13RecordLayer, ItsKeyMovesOnAfter2To23Records) {
  Peers p = make_peers(0x1301, EVP_sha256(), Tls13RecordLayer::kKeyUpdateAfterRecords - 1);
  const std::string first = "last under the first key", second = "first under the next";
  for (const std::string& text : {first, second})
    ASSERT_EQ(p.a->write(p.a_fd.get(), text).status, IoResult::Status::kOk);
  // On the wire: the first record, a KeyUpdate (5 + 5 + 1 + 16 bytes), the second record.
  char wire[256];
  ssize_t n = ::recv(p.b_fd.get(), wire, sizeof wire, 0);
  const size_t first_len = 5 + first.size() + 1 + 16;
  ASSERT_EQ(static_cast<size_t>(n), first_len + 27 + 5 + second.size() + 1 + 16);
  EXPECT_EQ(wire[first_len + 4], 22) << "a 22-byte KeyUpdate record's length";
  ASSERT_EQ(::send(p.a_fd.get(), wire, static_cast<size_t>(n), MSG_NOSIGNAL), n);  // back, for the reader
  EXPECT_EQ(read_all(*p.b, p.b_fd.get(), first.size() + second.size()), first + second);
}

TEST(Tls13RecordLayer, AReaderWithLittleRoomGetsARecordInPartsAndKnowsTheRestIsHeld) {
  Peers p = make_peers(0x1303, EVP_sha256());
  ASSERT_EQ(p.a->write(p.a_fd.get(), std::string_view("0123456789")).status, IoResult::Status::kOk);
  char small[4];
  IoResult r = p.b->read(p.b_fd.get(), small);
  EXPECT_EQ(r.status, IoResult::Status::kOk);
  EXPECT_EQ(std::string(small, r.bytes), "0123");
  EXPECT_TRUE(p.b->has_buffered_input()) << "poll cannot see it";
  EXPECT_EQ(read_all(*p.b, p.b_fd.get(), 6, 4), "456789");
  EXPECT_FALSE(p.b->has_buffered_input());
  r = p.b->read(p.b_fd.get(), small);
  EXPECT_EQ(r.status, IoResult::Status::kWouldBlock);
}

TEST(Tls13RecordLayer, ADamagedRecordIsAnErrorAndTheBytesBeforeItCount) {
  Peers p = make_peers(0x1301, EVP_sha256());
  ASSERT_EQ(p.a->write(p.a_fd.get(), std::string_view("good")).status, IoResult::Status::kOk);
  // A second record, taken off the wire, one bit changed, and put back.
  ASSERT_EQ(p.a->write(p.a_fd.get(), std::string_view("bad")).status, IoResult::Status::kOk);
  char wire[256];
  ssize_t n = ::recv(p.b_fd.get(), wire, sizeof wire, 0);
  ASSERT_GT(n, 30);
  wire[n - 1] ^= 1;
  ASSERT_EQ(::send(p.a_fd.get(), wire, static_cast<size_t>(n), MSG_NOSIGNAL), n);
  char buf[64];
  IoResult r = p.b->read(p.b_fd.get(), buf);
  EXPECT_EQ(r.status, IoResult::Status::kError);
  EXPECT_EQ(std::string(buf, r.bytes), "good");
  EXPECT_NE(r.detail.find("bad_record_mac"), std::string::npos) << r.detail;
}

TEST(Tls13RecordLayer, CloseNotifyIsTheEndAndAnEofInsideARecordIsAnError) {
  Peers p = make_peers(0x1301, EVP_sha256());
  ASSERT_EQ(p.a->write(p.a_fd.get(), std::string_view("last")).status, IoResult::Status::kOk);
  EXPECT_TRUE(p.a->shutdown_write(p.a_fd.get()));
  char buf[64];
  IoResult r = p.b->read(p.b_fd.get(), buf);
  EXPECT_EQ(r.status, IoResult::Status::kEof);
  EXPECT_EQ(std::string(buf, r.bytes), "last");

  Peers q = make_peers(0x1301, EVP_sha256());
  ASSERT_EQ(::send(q.a_fd.get(), "\x17\x03\x03\x00\x40partial", 12, MSG_NOSIGNAL), 12);
  ::shutdown(q.a_fd.get(), SHUT_WR);
  r = q.b->read(q.b_fd.get(), buf);
  EXPECT_EQ(r.status, IoResult::Status::kWouldBlock) << "a part of a record: the rest may come";
  r = q.b->read(q.b_fd.get(), buf);
  EXPECT_EQ(r.status, IoResult::Status::kError);
  EXPECT_NE(r.detail.find("inside a TLS record"), std::string::npos) << r.detail;
}

}  // namespace
}  // namespace sg
