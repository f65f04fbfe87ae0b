#include "proxy/fd_limits.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include "proxy/route_cache.h"

namespace sg {
namespace {

TEST(FdLimits, ConnectionsFollowTheDescriptorLimit) {
  // (nofile - kReservedFds) / fds per connection, never 0: 3 without kTLS (two sockets and the node
  // request), 6 with it (two splice pipes more).
  EXPECT_EQ(max_connections_for_fd_limit(1024, false), (1024u - 64u) / 3u);
  EXPECT_EQ(max_connections_for_fd_limit(1024, false), 320u);
  EXPECT_EQ(max_connections_for_fd_limit(1024, true), 160u);
  EXPECT_EQ(max_connections_for_fd_limit(65536, false), 21824u);
  EXPECT_EQ(max_connections_for_fd_limit(65536, true), 10912u);
  EXPECT_EQ(max_connections_for_fd_limit(0, false), 1u);
  EXPECT_EQ(max_connections_for_fd_limit(kReservedFds, true), 1u);
  // The route caches' spares come out of the same budget.
  EXPECT_EQ(spare_sockets_for_fd_limit(1024, 2), 32u);
  EXPECT_EQ(spare_sockets_for_fd_limit(1u << 20, 2), RouteCache::kDefaultMaxSpares) << "capped";
  EXPECT_EQ(spare_sockets_for_fd_limit(1024, 0), 64u) << "workers 0 counts as 1";
  EXPECT_EQ(max_connections_for_fd_limit(kReservedFds + 2 * kFdsPerConnection, false), 2u);
  EXPECT_EQ(max_connections_for_fd_limit(kReservedFds + 2 * kFdsPerSplicedConnection, true), 2u);
  // An unlimited soft limit saturates instead of wrapping.
  EXPECT_EQ(max_connections_for_fd_limit(RLIM_INFINITY, true), UINT32_MAX);
}

TEST(FdLimits, RaiseReachesTheHardLimit) {
  auto lim = raise_fd_limit();
  ASSERT_TRUE(lim.ok()) << lim.message();
  rlimit now{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &now), 0);
  EXPECT_EQ(lim->soft, now.rlim_cur);
  EXPECT_EQ(lim->hard, now.rlim_max);
  if (now.rlim_max != RLIM_INFINITY) {
    EXPECT_EQ(now.rlim_cur, now.rlim_max);
  }
}

}  // namespace
}  // namespace sg
