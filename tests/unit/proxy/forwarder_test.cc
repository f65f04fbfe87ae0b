// One Direction between two TcpTransports over socketpairs, driven by calling move() (no loop): bytes
// arrive in order copied or spliced, what the buffer or the source transport held goes before the pipe, a
// stage sees every byte,
// EOF shuts the sink once everything is delivered, and a failing sink is reported.
#include "proxy/forwarder.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>

#include <string>

#include "common/fd.h"

namespace sg {
namespace {

struct Pair {
  UniqueFd ours;    // the direction's end
  UniqueFd theirs;  // the test's end
};

Pair socket_pair() {
  int sv[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv), 0);
  return {UniqueFd(sv[0]), UniqueFd(sv[1])};
}

std::string pattern(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>('a' + i % 23);
  return s;
}

// The connection's side of a direction, faked: it records what the direction reports.
struct Events : DirectionEvents {
  size_t received_bytes = 0;
  std::string observed;  // what observe() was shown
  bool finished = false;
  bool sink_failed_seen = false;
  std::string sink_detail;
  bool splice_allowed = false;

  void received(size_t n) override { received_bytes += n; }
  void observe(std::string_view bytes) override { observed.append(bytes); }
  bool source_finished() override {
    finished = true;
    return true;
  }
  bool source_failed(IoResult r) override {
    ADD_FAILURE() << "source failed: " << r.detail;
    return false;
  }
  bool sink_failed(IoResult r) override {
    sink_failed_seen = true;
    sink_detail = r.detail;
    return false;
  }
  bool may_splice() const override { return splice_allowed; }
  bool splice_refused(std::string why) override {
    ADD_FAILURE() << "splice refused: " << why;
    return false;
  }
};

class DirectionTest : public ::testing::Test {
 protected:
  void make(bool may_splice, ByteBuffer buffer = ByteBuffer(4096)) {
    events_.splice_allowed = may_splice;
    dir_ = std::make_unique<Direction>(&source_, &sink_, std::move(buffer), events_);
  }

  // Writes `data` into the source while moving, and reads the sink until `want` bytes or EOF.
  std::string pass(const std::string& data, size_t want) {
    std::string got;
    size_t sent = 0;
    for (int spins = 0; spins < 100000 && got.size() < want; ++spins) {
      if (sent < data.size()) {
        ssize_t n = ::send(src_.theirs.get(), data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
        if (n > 0) sent += static_cast<size_t>(n);
      }
      EXPECT_TRUE(dir_->move());
      char buf[65536];
      ssize_t n = ::recv(dst_.theirs.get(), buf, sizeof buf, 0);
      if (n > 0) got.append(buf, static_cast<size_t>(n));
      if (n == 0) break;
    }
    return got;
  }

  Pair src_ = socket_pair();
  Pair dst_ = socket_pair();
  TcpTransport source_{src_.ours.get()};
  TcpTransport sink_{dst_.ours.get()};
  Events events_;
  std::unique_ptr<Direction> dir_;
};

TEST_F(DirectionTest, CopiesInOrderAndShutsTheSinkAfterTheSourceEnds) {
  make(/*may_splice=*/false);
  const std::string data = pattern(1 << 20);
  EXPECT_EQ(pass(data, data.size()), data);
  EXPECT_FALSE(dir_->spliced());
  EXPECT_EQ(events_.received_bytes, data.size());
  EXPECT_TRUE(events_.observed == data) << "the observer saw every copied byte once, in order";
  src_.theirs.reset();  // EOF
  ASSERT_TRUE(dir_->move());
  EXPECT_TRUE(events_.finished);
  EXPECT_TRUE(dir_->source_done());
  dir_->shut_sink_when_done();
  EXPECT_TRUE(dir_->sink_shut());
  char byte;
  EXPECT_EQ(::recv(dst_.theirs.get(), &byte, 1, 0), 0) << "FIN to the sink";
  EXPECT_FALSE(dir_->wants_source_readable());
  EXPECT_FALSE(dir_->wants_sink_writable());
}

// A kernel-TLS source holds what it read past a nearly full reader's room (KernelTlsTransport); those bytes
// came off the socket first, so they go out before anything the direction splices from it.
TEST_F(DirectionTest, BytesTheSourceHoldsGoBeforeWhatItSplices) {
  KernelTlsTransport ktls(src_.ours.get());
  ASSERT_EQ(::send(src_.theirs.get(), "0123456789", 10, MSG_NOSIGNAL), 10);
  char four[4];
  ASSERT_EQ(ktls.read(four).bytes, 4u);
  ASSERT_TRUE(ktls.has_buffered_input()) << "\"456789\" stays with the transport";
  events_.splice_allowed = true;
  dir_ = std::make_unique<Direction>(&ktls, &sink_, ByteBuffer(4096), events_);
  const std::string more = pattern(100000);
  EXPECT_EQ(pass(more, 6 + more.size()), "456789" + more);
  EXPECT_TRUE(dir_->spliced());
  dir_.reset();
}

TEST_F(DirectionTest, SplicesWhenBothEndsCanAndTheBufferGoesFirst) {
  ByteBuffer head(4096);
  const std::string first = "what the buffer held";
  std::memcpy(head.write_ptr(), first.data(), first.size());
  head.produced(first.size());
  make(/*may_splice=*/true, std::move(head));
  const std::string data = pattern(1 << 20);
  EXPECT_EQ(pass(data, first.size() + data.size()), first + data);
  EXPECT_TRUE(dir_->spliced());
  EXPECT_EQ(events_.received_bytes, data.size()) << "the buffer's bytes were counted by whoever filled it";
  EXPECT_EQ(dir_->pending(), 0u);
}

// A watcher on a spliced direction (the response tracker on kTLS) lets through unseen only what it need not
// read: here bytes [64 KiB, 576 KiB) of the stream, a body between two parts it must see.
TEST_F(DirectionTest, ASpliceBudgetSplicesOnlyWhatTheWatcherNeedNotSee) {
  constexpr uint64_t kSeenUntil = 64 * 1024, kSeenFrom = 576 * 1024;
  // A watcher that must see the stream before kSeenUntil and from kSeenFrom on.
  struct Watcher : Events {
    uint64_t position = 0;  // stream bytes taken from the source so far
    uint64_t unseen = 0;
    bool unseen_outside = false;
    void observe(std::string_view bytes) override {
      observed.append(bytes);
      position += bytes.size();
    }
    uint64_t splice_budget() const override {
      return position >= kSeenUntil && position < kSeenFrom ? kSeenFrom - position : 0;
    }
    void passed_unseen(size_t n) override {
      if (position < kSeenUntil || position + n > kSeenFrom) unseen_outside = true;
      position += n;
      unseen += n;
    }
  } watcher;
  watcher.splice_allowed = true;
  dir_ = std::make_unique<Direction>(&source_, &sink_, ByteBuffer(4096), watcher);
  const std::string data = pattern(640 * 1024);
  EXPECT_EQ(pass(data, data.size()), data) << "in order, whether copied or spliced";
  EXPECT_FALSE(watcher.unseen_outside) << "no byte the watcher must see was spliced past it";
  EXPECT_EQ(watcher.position, data.size()) << "every byte was either shown or counted as unseen, once";
  EXPECT_EQ(watcher.observed.size() + watcher.unseen, data.size());
  EXPECT_EQ(watcher.observed.substr(0, kSeenUntil), data.substr(0, kSeenUntil));
  EXPECT_EQ(watcher.observed.substr(watcher.observed.size() - 64 * 1024), data.substr(kSeenFrom))
      << "the part after the body was shown";
  EXPECT_GT(watcher.unseen, 400u * 1024) << "the body was spliced, not copied through the 4 KiB buffer";
  dir_.reset();  // before the watcher it holds
}

TEST_F(DirectionTest, AStageSeesEveryByteAndWhatItWritesIsSent) {
  make(/*may_splice=*/false);  // the connection allows no splice while a stage must read every byte
  dir_->set_stage([](std::string_view in, std::string& out) {
    for (char c : in) out.push_back(static_cast<char>(std::toupper(static_cast<unsigned char>(c))));
    return true;
  });
  const std::string data = pattern(200000);
  std::string upper = data;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  EXPECT_EQ(pass(data, data.size()), upper);
}

TEST_F(DirectionTest, AFailingSinkIsReported) {
  make(/*may_splice=*/false);
  dst_.theirs.reset();
  const std::string data = "for nobody";
  ASSERT_EQ(::send(src_.theirs.get(), data.data(), data.size(), MSG_NOSIGNAL), static_cast<ssize_t>(data.size()));
  EXPECT_FALSE(dir_->move());
  EXPECT_TRUE(events_.sink_failed_seen);
  EXPECT_FALSE(events_.sink_detail.empty());
}

// Issue 12 (RSS per idle connection): a direction waiting for its source keeps its buffer and its staging
// string for the next bytes until it is told to give them back (the connection does after a quiet while);
// then it holds none; bytes in flight keep theirs; the next bytes get memory again.
TEST_F(DirectionTest, AnIdleDirectionGivesItsMemoryBackWhenToldAndTakesItAgainForTheNextBytes) {
  make(/*may_splice=*/false);
  dir_->set_stage([](std::string_view in, std::string& out) {
    out.append(in);
    return true;
  });
  EXPECT_FALSE(dir_->holds_memory()) << "nothing read yet";
  const std::string first = pattern(100000);
  EXPECT_EQ(pass(first, first.size()), first);
  ASSERT_TRUE(dir_->move());  // the source has nothing more: the read would block
  EXPECT_TRUE(dir_->holds_memory()) << "kept for the next bytes";
  dir_->release_memory_while_idle();
  EXPECT_FALSE(dir_->holds_memory()) << "idle, everything delivered";
  EXPECT_EQ(dir_->pending(), 0u);

  // Bytes the sink cannot take yet stay, and keep their memory.
  std::string filler(1 << 20, 'f');
  while (::send(dst_.ours.get(), filler.data(), filler.size(), MSG_NOSIGNAL) > 0) {
  }
  const std::string second = pattern(3000);
  ASSERT_EQ(::send(src_.theirs.get(), second.data(), second.size(), MSG_NOSIGNAL), 3000);
  dir_->source_readable();
  ASSERT_TRUE(dir_->move());
  ASSERT_TRUE(dir_->move());
  EXPECT_EQ(dir_->pending(), 3000u);
  dir_->release_memory_while_idle();
  EXPECT_TRUE(dir_->holds_memory()) << "bytes in flight";

  // Once the sink drains they go out whole, after the filler, and the memory goes again.
  std::string got;
  for (int spins = 0; spins < 100000 && got.size() < second.size(); ++spins) {
    ASSERT_TRUE(dir_->move());
    char buf[65536];
    ssize_t n = ::recv(dst_.theirs.get(), buf, sizeof buf, 0);
    if (n > 0) got.append(buf, static_cast<size_t>(n));
    got.erase(0, std::min(got.find_first_not_of('f'), got.size()));
  }
  EXPECT_EQ(got, second);
  ASSERT_TRUE(dir_->move());
  dir_->release_memory_while_idle();
  EXPECT_FALSE(dir_->holds_memory());
}

// A half-closed connection (the client sent its FIN, the sandbox keeps its side open) may stay for long: the
// buffer the read of the EOF took goes back too, although the direction never learnt that its source would
// block (10,000 such connections kept 6.5-11 KiB each in the kTLS guest's soak before).
TEST_F(DirectionTest, ADirectionWhoseSourceEndedGivesItsMemoryBack) {
  make(/*may_splice=*/false);
  const std::string data = pattern(3000);
  EXPECT_EQ(pass(data, data.size()), data);
  ASSERT_TRUE(dir_->move());  // the source has nothing more: the read would block
  dir_->release_memory_while_idle();
  ASSERT_FALSE(dir_->holds_memory());
  src_.theirs.reset();  // EOF
  dir_->source_readable();
  ASSERT_TRUE(dir_->move());
  ASSERT_TRUE(dir_->source_done());
  EXPECT_TRUE(dir_->holds_memory()) << "the read that found the EOF took the buffer";
  dir_->release_memory_while_idle();
  EXPECT_FALSE(dir_->holds_memory());
  dir_->shut_sink_when_done();
  EXPECT_TRUE(dir_->sink_shut());
}

size_t open_descriptors() {
  size_t n = 0;
  for (int fd = 0; fd < 4096; ++fd) n += ::fcntl(fd, F_GETFD) != -1;
  return n;
}

// Issue 12: an idle spliced direction (kTLS) gives its pipe back, two descriptors and the kernel's pipe, and
// the next bytes splice through a new one, in order.
TEST_F(DirectionTest, AnIdleSplicedDirectionGivesItsPipeBackAndSplicesTheNextBytesThroughANewOne) {
  make(/*may_splice=*/true);
  const std::string first = pattern(200000);
  EXPECT_TRUE(pass(first, first.size()) == first);
  ASSERT_TRUE(dir_->spliced());
  ASSERT_TRUE(dir_->move());  // the source has nothing more: the splice would block
  EXPECT_TRUE(dir_->holds_memory()) << "the pipe is kept for the next bytes until the connection is quiet";
  const size_t with_pipe = open_descriptors();
  dir_->release_memory_while_idle();
  EXPECT_FALSE(dir_->holds_memory());
  EXPECT_EQ(open_descriptors(), with_pipe - 2) << "the pipe's two ends are closed";
  EXPECT_TRUE(dir_->spliced()) << "still a spliced direction";
  ASSERT_TRUE(dir_->move());
  EXPECT_EQ(open_descriptors(), with_pipe - 2) << "no pipe before the source has bytes";

  const std::string second = pattern(300000).substr(7);
  dir_->source_readable();
  EXPECT_TRUE(pass(second, second.size()) == second);
  EXPECT_TRUE(dir_->spliced());
  EXPECT_EQ(open_descriptors(), with_pipe) << "a new pipe for the new bytes";
  EXPECT_EQ(events_.received_bytes, first.size() + second.size());
  src_.theirs.reset();  // EOF
  dir_->source_readable();
  ASSERT_TRUE(dir_->move());
  ASSERT_TRUE(dir_->source_done());
  dir_->release_memory_while_idle();
  EXPECT_FALSE(dir_->holds_memory());
}

// A pipe is given back only with nothing else in flight: bytes the buffer holds for a stalled sink (a
// response head on kTLS, copied for the watcher) go out before anything spliced after them, so the pipe stays
// until they are delivered.
TEST_F(DirectionTest, APipeStaysWhileTheBufferHoldsBytesForAStalledSink) {
  struct Watcher : Events {
    uint64_t budget = 0;  // 0: every byte is copied, for the watcher to see
    uint64_t splice_budget() const override { return budget; }
  } watcher;
  watcher.splice_allowed = true;
  dir_ = std::make_unique<Direction>(&source_, &sink_, ByteBuffer(4096), watcher);
  std::string filler(1 << 20, 'f');
  while (::send(dst_.ours.get(), filler.data(), filler.size(), MSG_NOSIGNAL) > 0) {
  }
  const std::string head = pattern(100);
  ASSERT_EQ(::send(src_.theirs.get(), head.data(), head.size(), MSG_NOSIGNAL), 100);
  ASSERT_TRUE(dir_->move());
  ASSERT_TRUE(dir_->move());  // the source has nothing more: its read would block
  ASSERT_TRUE(dir_->spliced());
  ASSERT_EQ(dir_->pending(), 100u) << "the head waits in the buffer for the sink";
  const size_t with_pipe = open_descriptors();
  dir_->release_memory_while_idle();
  EXPECT_EQ(open_descriptors(), with_pipe) << "the pipe stays";

  watcher.budget = UINT64_MAX;  // the body may pass unseen
  const std::string body = pattern(50000).substr(3);
  ASSERT_EQ(::send(src_.theirs.get(), body.data(), body.size(), MSG_NOSIGNAL), static_cast<ssize_t>(body.size()));
  dir_->source_readable();
  std::string got;
  for (int spins = 0; spins < 100000 && got.size() < head.size() + body.size(); ++spins) {
    ASSERT_TRUE(dir_->move());
    char buf[65536];
    ssize_t n = ::recv(dst_.theirs.get(), buf, sizeof buf, 0);
    if (n > 0) got.append(buf, static_cast<size_t>(n));
    got.erase(0, std::min(got.find_first_not_of('f'), got.size()));
  }
  EXPECT_TRUE(got == head + body) << got.size() << " bytes";
  dir_.reset();  // before the watcher it holds
}

TEST_F(DirectionTest, StopsReadingWhenTheBufferIsFull) {
  make(/*may_splice=*/false, ByteBuffer(16));
  const std::string data = pattern(64);
  ASSERT_EQ(::send(src_.theirs.get(), data.data(), data.size(), MSG_NOSIGNAL), 64);
  // A sink that takes nothing: shrink its peer's window by filling it first.
  std::string filler(1 << 20, 'f');
  while (::send(dst_.ours.get(), filler.data(), filler.size(), MSG_NOSIGNAL) > 0) {
  }
  ASSERT_TRUE(dir_->move());
  EXPECT_EQ(events_.received_bytes, 16u);
  EXPECT_EQ(dir_->pending(), 16u);
  EXPECT_FALSE(dir_->wants_source_readable()) << "no room: the source is not polled";
  EXPECT_TRUE(dir_->wants_sink_writable());
}

}  // namespace
}  // namespace sg
