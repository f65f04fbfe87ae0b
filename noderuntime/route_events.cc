#include "noderuntime/route_events.h"

#include <algorithm>
#include <chrono>
#include <vector>

namespace sg {

uint64_t RouteEvents::subscribe(Listener listener) {
  uint64_t id = next_subscription_++;
  listeners_.emplace(id, std::move(listener));
  return id;
}

void RouteEvents::unsubscribe(uint64_t subscription) { listeners_.erase(subscription); }

uint64_t RouteEvents::stamp() {
  auto wall_us =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  last_stamp_ = std::max(last_stamp_ + 1, static_cast<uint64_t>(std::max<int64_t>(wall_us, 0)));
  return last_stamp_;
}

void RouteEvents::publish(std::string id, std::string name, std::string reason) {
  if (listeners_.empty()) return;
  RouteEvent event{std::move(id), std::move(name), std::move(reason), stamp()};
  // A listener may unsubscribe others (a stream that failed to write closes), so ids are taken first.
  std::vector<uint64_t> ids;
  ids.reserve(listeners_.size());
  for (const auto& [subscription, listener] : listeners_) ids.push_back(subscription);
  for (uint64_t subscription : ids) {
    auto it = listeners_.find(subscription);
    if (it == listeners_.end()) continue;
    // A copy runs: a listener that unsubscribes itself would otherwise destroy the function it runs in.
    Listener listener = it->second;
    listener(event);
  }
}

}  // namespace sg
