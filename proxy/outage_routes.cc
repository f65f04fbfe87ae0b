#include "proxy/outage_routes.h"

#include <fcntl.h>

namespace sg {

size_t OutageRoutes::publish(const void* publisher, std::vector<SharedRoute> routes) {
  std::unordered_map<std::string, SharedRoute> mine;
  for (SharedRoute& r : routes) {
    if (mine.size() >= kMaxPerPublisher) break;
    if (!r.netns.valid()) continue;  // nothing to make its sockets in
    std::string key = r.key;
    mine.insert_or_assign(std::move(key), std::move(r));
  }
  const size_t held = mine.size();
  std::lock_guard lock(mu_);
  // The previous publication's descriptors close with `mine`, after the lock is released.
  if (mine.empty()) {
    auto it = by_publisher_.find(publisher);
    if (it != by_publisher_.end()) {
      mine = std::move(it->second);
      by_publisher_.erase(it);
    }
  } else {
    std::swap(by_publisher_[publisher], mine);
  }
  return held;
}

void OutageRoutes::withdraw(const void* publisher) {
  std::unordered_map<std::string, SharedRoute> gone;  // closed outside the lock
  std::lock_guard lock(mu_);
  auto it = by_publisher_.find(publisher);
  if (it == by_publisher_.end()) return;
  gone = std::move(it->second);
  by_publisher_.erase(it);
}

std::optional<SharedRoute> OutageRoutes::find(std::string_view key, bool with_namespace) const {
  const std::string k(key);
  std::lock_guard lock(mu_);
  for (const auto& [publisher, routes] : by_publisher_) {
    auto it = routes.find(k);
    if (it == routes.end()) continue;
    const SharedRoute& r = it->second;
    // Under the lock: the publisher's copy cannot be closed meanwhile.
    UniqueFd netns;
    if (with_namespace) {
      netns = UniqueFd(::fcntl(r.netns.get(), F_DUPFD_CLOEXEC, 0));
      if (!netns.valid()) return std::nullopt;  // out of descriptors: the connection gets the node's 503
    }
    return SharedRoute{r.key, r.policy, r.token_sha256, r.operator_token_sha256, r.connect_port, r.opened_at,
                  std::move(netns)};
  }
  return std::nullopt;
}

size_t OutageRoutes::size() const {
  std::lock_guard lock(mu_);
  size_t n = 0;
  for (const auto& [publisher, routes] : by_publisher_) n += routes.size();
  return n;
}

}  // namespace sg
