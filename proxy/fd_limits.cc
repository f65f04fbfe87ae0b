#include "proxy/fd_limits.h"

#include <sys/resource.h>

#include <algorithm>
#include <cerrno>

#include "proxy/route_cache.h"

namespace sg {

uint32_t spare_sockets_for_fd_limit(uint64_t nofile, unsigned workers) {
  return static_cast<uint32_t>(std::min<uint64_t>(nofile / 16 / std::max(workers, 1u), RouteCache::kDefaultMaxSpares));
}

uint32_t max_connections_for_fd_limit(uint64_t nofile, bool splice_pipes) {
  const uint64_t per_connection = fds_per_connection(splice_pipes);
  if (nofile <= kReservedFds + per_connection) return 1;
  return static_cast<uint32_t>(std::min<uint64_t>((nofile - kReservedFds) / per_connection, UINT32_MAX));
}

Result<FdLimit> raise_fd_limit() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return fail_errno("getrlimit(RLIMIT_NOFILE)", errno);
  if (lim.rlim_cur < lim.rlim_max && lim.rlim_max != RLIM_INFINITY) {
    rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max;
    // Failure is not fatal: the proxy runs within the current limit, which the caller logs.
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) lim = raised;
  }
  return FdLimit{static_cast<uint64_t>(lim.rlim_cur), static_cast<uint64_t>(lim.rlim_max)};
}

}  // namespace sg
