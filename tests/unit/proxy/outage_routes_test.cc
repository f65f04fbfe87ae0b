#include "proxy/outage_routes.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <thread>

namespace sg {
namespace {

SharedRoute route(std::string key, std::string id) {
  SharedRoute r;
  r.key = std::move(key);
  r.policy = PortPolicy{std::move(id), "http1", false};
  r.token_sha256 = "aa";
  r.connect_port = 8080;
  r.opened_at = 7;
  r.netns = UniqueFd(::open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC));
  return r;
}

bool open_fd(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

TEST(OutageRoutes, AFoundRouteIsACopyWithANamespaceDescriptorOfItsOwn) {
  OutageRoutes board;
  int a = 0, b = 0;
  std::vector<SharedRoute> mine;
  mine.push_back(route("demo:8080", "sb-1"));
  mine.push_back(SharedRoute{"nons:8080", {}, "", "", 0, 0, UniqueFd()});  // no namespace: left out
  const int published_fd = mine[0].netns.get();
  board.publish(&a, std::move(mine));
  EXPECT_EQ(board.size(), 1u);
  EXPECT_FALSE(board.find("nons:8080"));
  EXPECT_FALSE(board.find("demo:8081"));
  auto found = board.find("demo:8080");
  ASSERT_TRUE(found);
  EXPECT_EQ(found->policy.sandbox_id, "sb-1");
  EXPECT_EQ(found->connect_port, 8080);
  EXPECT_EQ(found->opened_at, 7u);
  ASSERT_TRUE(found->netns.valid());
  EXPECT_NE(found->netns.get(), published_fd);
  struct stat x{}, y{};
  ASSERT_EQ(::fstat(found->netns.get(), &x), 0);
  ASSERT_EQ(::stat("/proc/self/ns/net", &y), 0);
  EXPECT_EQ(x.st_ino, y.st_ino);
  EXPECT_TRUE(::fcntl(found->netns.get(), F_GETFD) & FD_CLOEXEC);

  std::vector<SharedRoute> theirs;
  theirs.push_back(route("other:8080", "sb-2"));
  board.publish(&b, std::move(theirs));
  EXPECT_EQ(board.size(), 2u);
  board.withdraw(&a);
  EXPECT_FALSE(open_fd(published_fd)) << "closed with the withdrawal";
  EXPECT_TRUE(found->netns.valid() && open_fd(found->netns.get())) << "a copy taken stays the taker's";
  EXPECT_FALSE(board.find("demo:8080"));
  EXPECT_TRUE(board.find("other:8080"));
  board.withdraw(&a);  // twice: nothing
  std::vector<SharedRoute> again;
  again.push_back(route("third:8080", "sb-3"));
  board.publish(&b, std::move(again));
  EXPECT_FALSE(board.find("other:8080")) << "a publication replaces the last";
  EXPECT_TRUE(board.find("third:8080"));
  board.publish(&b, {});
  EXPECT_EQ(board.size(), 0u);
}

TEST(OutageRoutes, APublicationIsBounded) {
  OutageRoutes board;
  int a = 0;
  std::vector<SharedRoute> many;
  for (size_t i = 0; i < OutageRoutes::kMaxPerPublisher + 5; ++i) many.push_back(route("sb" + std::to_string(i) + ":1", "x"));
  board.publish(&a, std::move(many));
  EXPECT_EQ(board.size(), OutageRoutes::kMaxPerPublisher);
}

// Workers publish, withdraw and look up from their own threads.
TEST(OutageRoutes, WorkersUseItFromTheirThreads) {
  OutageRoutes board;
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w)
    threads.emplace_back([&board, w] {
      int me = 0;  // the publisher
      for (int i = 0; i < 200; ++i) {
        std::vector<SharedRoute> mine;
        mine.push_back(route("w" + std::to_string(w) + ":1", "x"));
        board.publish(&me, std::move(mine));
        auto found = board.find("w" + std::to_string((w + 1) % 4) + ":1");
        if (found) {
          EXPECT_TRUE(found->netns.valid());
        }
        if (i % 3 == 0) board.withdraw(&me);
      }
      board.withdraw(&me);
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(board.size(), 0u);
}

}  // namespace
}  // namespace sg
