#include "common/fd.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>

namespace sg {
namespace {

// What `data` reads as through a stream socket (written from another thread: it may exceed the socket's
// buffer; MSG_NOSIGNAL, since the reader may stop at its limit and close first).
Result<std::string> through_socket(const std::string& data, size_t max_bytes) {
  int fds[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  UniqueFd in(fds[0]), out(fds[1]);
  std::thread writer([&] {
    size_t sent = 0;
    while (sent < data.size()) {
      ssize_t n = ::send(out.get(), data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) break;  // the reader stopped at its limit and closed
      sent += static_cast<size_t>(n);
    }
    out.reset();
  });
  auto got = read_at_most(in.get(), max_bytes, "the test socket");
  in.reset();
  writer.join();
  return got;
}

TEST(ReadAtMost, ReadsToTheEndAcrossManyReadsAndStopsOneByteOverTheLimit) {
  const std::string big(300 * 1024 + 7, 'x');
  auto all = through_socket(big, big.size());
  ASSERT_TRUE(all) << all.message();
  EXPECT_EQ(*all, big);
  auto over = through_socket(big, 1000);
  ASSERT_TRUE(over) << over.message();
  EXPECT_EQ(over->size(), 1001u) << "one byte over the limit says the input exceeds it";
  auto empty = through_socket("", 10);
  ASSERT_TRUE(empty);
  EXPECT_TRUE(empty->empty());
}

// A large limit costs nothing for a small input: the buffer grows with what arrives (a 512 MiB limit once
// allocated and zeroed 512 MiB for every checkpoint's few-KiB index).
TEST(ReadAtMost, ASmallInputUnderAHugeLimitTakesASmallBuffer) {
  auto got = through_socket("sandgate-checkpoint-index 1\n", size_t{512} << 20);
  ASSERT_TRUE(got) << got.message();
  EXPECT_EQ(*got, "sandgate-checkpoint-index 1\n");
  EXPECT_LT(got->capacity(), size_t{1} << 20);
}

TEST(ReadAtMost, AReadErrorNamesWhatWasRead) {
  auto got = read_at_most(-1, 10, "the missing file");
  ASSERT_FALSE(got);
  EXPECT_NE(got.message().find("the missing file"), std::string::npos) << got.message();
}

}  // namespace
}  // namespace sg
