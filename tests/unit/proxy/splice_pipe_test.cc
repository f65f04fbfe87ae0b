// SplicePipe over real loopback TCP sockets: bytes arrive in order, EOF is reported, and a pipe that stops
// accepting is reported full until a drain frees room (so the forwarder does not poll a source it cannot read).
#include "proxy/splice_pipe.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <string>

#include "tests/unit/tcp_pair.h"

namespace sg {
namespace {

using testing::connected_tcp_pair;

std::string pattern(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>('a' + i % 23);
  return s;
}

TEST(SplicePipe, ForwardsBytesInOrderAndReportsEof) {
  auto in = connected_tcp_pair();
  auto out = connected_tcp_pair();
  auto pipe = SplicePipe::create(64 * 1024);
  ASSERT_TRUE(pipe) << pipe.message();
  std::string sent = pattern(300 * 1000);  // more than the pipe holds: several fill/drain rounds
  size_t written = 0;
  std::string received;
  bool eof = false;
  for (int i = 0; i < 100000 && !eof; ++i) {
    if (written < sent.size()) {
      ssize_t w = ::send(in.a.get(), sent.data() + written, std::min<size_t>(sent.size() - written, 65536),
                         MSG_DONTWAIT);
      if (w > 0) written += static_cast<size_t>(w);
      if (written == sent.size()) ::shutdown(in.a.get(), SHUT_WR);
    }
    if ((*pipe)->accepts_more()) {
      ssize_t n = (*pipe)->fill(in.b.get());
      if (n == 0) {
        eof = true;
      } else if (n < 0) {
        ASSERT_EQ(errno, EAGAIN);
      }
    }
    if ((*pipe)->buffered() > 0) {
      ASSERT_GT((*pipe)->drain(out.a.get()), 0);
    }
    char buf[65536];
    ssize_t r = ::recv(out.b.get(), buf, sizeof buf, MSG_DONTWAIT);
    if (r > 0) received.append(buf, static_cast<size_t>(r));
  }
  ASSERT_TRUE(eof);
  EXPECT_EQ((*pipe)->buffered(), 0u);
  char buf[65536];
  for (ssize_t r; (r = ::recv(out.b.get(), buf, sizeof buf, MSG_DONTWAIT)) > 0;) received.append(buf, size_t(r));
  EXPECT_EQ(received, sent);
}

TEST(SplicePipe, StopsAcceptingWhenFullUntilDrained) {
  auto in = connected_tcp_pair();
  auto out = connected_tcp_pair();
  auto pipe = SplicePipe::create(64 * 1024);
  ASSERT_TRUE(pipe) << pipe.message();
  // Many small segments: each can take a pipe slot of its own.
  std::string piece = pattern(100);
  int one = 1;
  ::setsockopt(in.a.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  for (int i = 0; i < 2000; ++i) ASSERT_EQ(::send(in.a.get(), piece.data(), piece.size(), 0), 100);
  for (int i = 0; i < 10000 && (*pipe)->accepts_more(); ++i) (*pipe)->fill(in.b.get());
  EXPECT_FALSE((*pipe)->accepts_more());
  EXPECT_GT((*pipe)->buffered(), 0u);
  EXPECT_LE((*pipe)->buffered(), (*pipe)->capacity());
  ASSERT_GT((*pipe)->drain(out.a.get()), 0);
  EXPECT_TRUE((*pipe)->accepts_more());
}

}  // namespace
}  // namespace sg
