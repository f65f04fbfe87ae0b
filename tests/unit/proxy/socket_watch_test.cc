// SocketWatch over real loopback TCP sockets and a real libuv loop: uv_poll's level-triggered semantics
// (what the connection relies on), what stays registered in the epoll set after each change (read from
// /proc/self/fdinfo), and that a watch stopped by another's callback in the same loop turn gets nothing.
#include "proxy/socket_watch.h"

#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "tests/unit/tcp_pair.h"

namespace sg {
namespace {

struct TcpPair {
  UniqueFd ours;    // watched (the accepted, non-blocking end)
  UniqueFd theirs;  // the peer the test acts as
};

TcpPair connected_pair() {
  testing::TcpPair p = testing::connected_tcp_pair();
  return {std::move(p.b), std::move(p.a)};
}

// The peer resets the connection: close() with a zero linger sends RST.
void reset_by_peer(TcpPair& p) {
  linger abort_on_close{1, 0};
  ASSERT_EQ(::setsockopt(p.theirs.get(), SOL_SOCKET, SO_LINGER, &abort_on_close, sizeof abort_on_close), 0);
  p.theirs.reset();
}

struct Seen {
  int calls = 0;
  int status = 0;
  int events = 0;
};

void record(void* data, int status, int events) {
  auto* s = static_cast<Seen*>(data);
  ++s->calls;
  s->status = status;
  s->events = events;
}

// Registered descriptor -> the events asked for among EPOLLIN and EPOLLOUT, from the set's fdinfo
// ("tfd:        7 events:       19 ..."; the kernel adds EPOLLERR and EPOLLHUP to every mask).
std::map<int, unsigned> registered(const SocketWatchSet& set) {
  std::ifstream in("/proc/self/fdinfo/" + std::to_string(set.descriptor()));
  std::map<int, unsigned> out;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string key, events_key;
    int fd = -1;
    std::string mask;
    if (words >> key >> fd >> events_key >> mask && key == "tfd:" && events_key == "events:")
      out[fd] = static_cast<unsigned>(std::stoul(mask, nullptr, 16)) & (EPOLLIN | EPOLLOUT);
  }
  return out;
}

class SocketWatchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(uv_loop_init(&loop_), 0);
    ASSERT_TRUE(set_.open(&loop_));
  }
  void TearDown() override {
    set_.close();
    uv_run(&loop_, UV_RUN_DEFAULT);  // the set's handle closes
    EXPECT_EQ(uv_loop_close(&loop_), 0);
  }
  // `w` watches our end of `p` for `events`, recording into `seen`.
  void watch(SocketWatch& w, TcpPair& p, Seen& seen, int events) {
    w.init(&set_, p.ours.get(), record, &seen);
    ASSERT_TRUE(w.set(events));
  }
  // A few loop turns without blocking: enough for anything ready to be delivered.
  void turn() {
    for (int i = 0; i < 3; ++i) uv_run(&loop_, UV_RUN_NOWAIT);
  }

  uv_loop_t loop_{};
  SocketWatchSet set_;
};

TEST_F(SocketWatchTest, ReportsWhatIsWatchedForAsLongAsItIsReady) {
  TcpPair p = connected_pair();
  Seen seen;
  SocketWatch w;
  w.init(&set_, p.ours.get(), record, &seen);
  turn();
  EXPECT_EQ(seen.calls, 0) << "a watch of nothing reports nothing";
  EXPECT_TRUE(registered(set_).empty()) << "init alone registers nothing";

  ASSERT_TRUE(w.set(UV_READABLE));
  turn();
  EXPECT_EQ(seen.calls, 0) << "nothing to read yet";
  ASSERT_EQ(::write(p.theirs.get(), "x", 1), 1);
  uv_run(&loop_, UV_RUN_NOWAIT);
  EXPECT_EQ(seen.calls, 1);
  EXPECT_EQ(seen.status, 0);
  EXPECT_EQ(seen.events, UV_READABLE);
  // Level-triggered, like uv_poll: unread bytes are reported again at the next turn.
  uv_run(&loop_, UV_RUN_NOWAIT);
  EXPECT_EQ(seen.calls, 2);

  // Readable and writable: both reported, in one call.
  ASSERT_TRUE(w.set(UV_READABLE | UV_WRITABLE));
  uv_run(&loop_, UV_RUN_NOWAIT);
  EXPECT_EQ(seen.calls, 3);
  EXPECT_EQ(seen.events, UV_READABLE | UV_WRITABLE);
  EXPECT_EQ(registered(set_).at(p.ours.get()), unsigned{EPOLLIN | EPOLLOUT});

  // Watching nothing: no call, though the byte is still there, and the socket stays registered with no
  // events (so watching again is a MOD, not an ADD).
  ASSERT_TRUE(w.set(0));
  turn();
  EXPECT_EQ(seen.calls, 3);
  EXPECT_EQ(registered(set_).at(p.ours.get()), 0u);
  ASSERT_TRUE(w.set(UV_WRITABLE));
  uv_run(&loop_, UV_RUN_NOWAIT);
  EXPECT_EQ(seen.calls, 4);
  EXPECT_EQ(seen.events, UV_WRITABLE) << "only what is watched is reported";

  w.stop();
  EXPECT_TRUE(registered(set_).empty());
  turn();
  EXPECT_EQ(seen.calls, 4);
}

// Watching nothing is applied just before the loop waits: watching the same again or stopping first costs
// no epoll_ctl call, and what the kernel still reports meanwhile is not delivered.
TEST_F(SocketWatchTest, WatchingNothingIsAppliedOnlyIfItLastsUntilTheLoopWaits) {
  TcpPair p = connected_pair();
  Seen seen;
  SocketWatch w;
  watch(w, p, seen, UV_READABLE);
  const uint64_t after_add = set_.control_calls();

  ASSERT_TRUE(w.set(0));
  ASSERT_TRUE(w.set(UV_READABLE));
  turn();
  EXPECT_EQ(set_.control_calls(), after_add) << "nothing, then the same again: no call";
  EXPECT_EQ(registered(set_).at(p.ours.get()), unsigned{EPOLLIN});

  ASSERT_EQ(::write(p.theirs.get(), "x", 1), 1);
  ASSERT_TRUE(w.set(0));
  EXPECT_EQ(registered(set_).at(p.ours.get()), unsigned{EPOLLIN}) << "not applied yet";
  turn();
  EXPECT_EQ(seen.calls, 0) << "readable, but nothing is watched";
  EXPECT_EQ(registered(set_).count(p.ours.get()), 1u) << "still registered, so watching again is one MOD";
  EXPECT_EQ(registered(set_).at(p.ours.get()), 0u);

  ASSERT_TRUE(w.set(UV_READABLE));
  uv_run(&loop_, UV_RUN_NOWAIT);
  EXPECT_EQ(seen.calls, 1);
  const uint64_t before_stop = set_.control_calls();
  ASSERT_TRUE(w.set(0));
  w.stop();
  EXPECT_EQ(set_.control_calls(), before_stop + 1) << "nothing, then stopped: only the EPOLL_CTL_DEL";
  turn();
  EXPECT_TRUE(registered(set_).empty());
  EXPECT_EQ(set_.control_calls(), before_stop + 1);
  EXPECT_EQ(seen.calls, 1);
}

TEST_F(SocketWatchTest, AnErrorWhileNothingIsWatchedLeavesTheSetAndIsReportedOnceWatchedAgain) {
  TcpPair p = connected_pair();
  Seen seen;
  SocketWatch w;
  watch(w, p, seen, UV_READABLE);
  ASSERT_TRUE(w.set(0));  // e.g. a handshake waiting for the node's answer
  ASSERT_EQ(registered(set_).count(p.ours.get()), 1u);
  reset_by_peer(p);
  turn();
  EXPECT_EQ(seen.calls, 0);
  // epoll reports an error or a hang-up whatever the mask; a level-triggered set would report it at every
  // turn, so the watch left the set at the first one.
  EXPECT_TRUE(registered(set_).empty());

  ASSERT_TRUE(w.set(UV_READABLE));
  EXPECT_EQ(registered(set_).count(p.ours.get()), 1u);
  uv_run(&loop_, UV_RUN_NOWAIT);
  EXPECT_EQ(seen.calls, 1);
  EXPECT_EQ(seen.status, UV_EBADF);
}

TEST_F(SocketWatchTest, ThePeersEndOfStreamIsReadable) {
  TcpPair p = connected_pair();
  Seen seen;
  SocketWatch w;
  watch(w, p, seen, UV_READABLE);
  ASSERT_EQ(::shutdown(p.theirs.get(), SHUT_WR), 0);
  uv_run(&loop_, UV_RUN_NOWAIT);
  EXPECT_EQ(seen.calls, 1);
  EXPECT_EQ(seen.status, 0);
  EXPECT_EQ(seen.events, UV_READABLE);
  char c;
  EXPECT_EQ(::read(p.ours.get(), &c, 1), 0);
}

TEST_F(SocketWatchTest, AResetIsReportedOnceAsAnErrorAndThenNothingIsWatched) {
  TcpPair p = connected_pair();
  Seen seen;
  SocketWatch w;
  watch(w, p, seen, UV_READABLE);
  reset_by_peer(p);
  turn();
  EXPECT_EQ(seen.calls, 1);
  EXPECT_EQ(seen.status, UV_EBADF);  // as uv_poll reports EPOLLERR
  EXPECT_EQ(seen.events, 0);
  EXPECT_EQ(w.events(), 0);
  EXPECT_TRUE(registered(set_).empty());
}

// A connection's callback closes it, stopping both of its watches, while the other socket's event is
// already in the same batch: that event must not be delivered (its watch may be freed).
TEST_F(SocketWatchTest, AWatchStoppedByAnotherCallbackInTheSameTurnGetsNothing) {
  TcpPair a = connected_pair();
  TcpPair b = connected_pair();
  struct Pair {
    SocketWatch* watches[2];
    int calls = 0;
  } both;
  auto* wa = new SocketWatch;
  auto* wb = new SocketWatch;
  both.watches[0] = wa;
  both.watches[1] = wb;
  auto close_both = [](void* data, int, int) {
    auto* p = static_cast<Pair*>(data);
    ++p->calls;
    for (SocketWatch*& w : p->watches) {
      delete w;  // stops it
      w = nullptr;
    }
  };
  wa->init(&set_, a.ours.get(), close_both, &both);
  wb->init(&set_, b.ours.get(), close_both, &both);
  ASSERT_TRUE(wa->set(UV_READABLE));
  ASSERT_TRUE(wb->set(UV_READABLE));
  ASSERT_EQ(::write(a.theirs.get(), "x", 1), 1);
  ASSERT_EQ(::write(b.theirs.get(), "y", 1), 1);
  turn();
  EXPECT_EQ(both.calls, 1);
  EXPECT_TRUE(registered(set_).empty());
}

// What the connection closes with socket_watch_failed: the kernel refusing the watch (here EPERM, a regular
// file; in production ENOMEM or fs.epoll.max_user_watches) is an error, and the watch stays as it was.
TEST_F(SocketWatchTest, AWatchTheKernelRefusesIsAnErrorAndChangesNothing) {
  UniqueFd file(::open("/proc/self/stat", O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(file.valid());
  Seen seen;
  SocketWatch w;
  w.init(&set_, file.get(), record, &seen);
  Status s = w.set(UV_READABLE);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("epoll_ctl"), std::string::npos) << s.message();
  EXPECT_EQ(w.events(), 0);
  EXPECT_TRUE(registered(set_).empty());
  w.stop();
  turn();
  EXPECT_EQ(seen.calls, 0);
}

TEST_F(SocketWatchTest, ManyReadySocketsAreAllServedOverSeveralTurns) {
  const int n = SocketWatchSet::kBatch * 2 + 5;
  std::vector<TcpPair> pairs;
  std::vector<Seen> seen(n);
  std::vector<SocketWatch> watches(n);
  for (int i = 0; i < n; ++i) {
    pairs.push_back(connected_pair());
    watches[i].init(&set_, pairs[i].ours.get(), record, &seen[i]);
    ASSERT_TRUE(watches[i].set(UV_WRITABLE));
  }
  turn();  // three turns of at most kBatch each
  for (int i = 0; i < n; ++i) EXPECT_GE(seen[i].calls, 1) << "socket " << i;
}

}  // namespace
}  // namespace sg
