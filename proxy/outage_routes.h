// The routes each worker serves during a node outage, for the other workers. Route caches are per worker
// (proxy/route_cache.h) and a new connection lands on any worker (one SO_REUSEPORT listener each), so
// without this a sandbox reached only through one worker before the node went down got 503 on the others.
//
// A worker's route cache publishes, when its outage begins, the routes it will serve whose network
// namespace the node sent (descriptors duplicated here), and withdraws them when the outage ends for it (the
// node back, alive without its events, or the event stream back). Another worker in an outage of its own
// that holds no route for a sandbox port takes a copy of a published one (namespace duplicated again) and
// serves it as its own: every worker's event stream saw the same events until the node went, and a node
// that is down changes nothing. Thread-safe (one mutex; used only during outages, per connection that
// misses its worker's cache).
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/fd.h"
#include "proxy/route_cache.h"

namespace sg {

class OutageRoutes {
 public:
  // Descriptors held here per publisher (one namespace per route): the rest of a larger publication is
  // left out.
  static constexpr size_t kMaxPerPublisher = 1024;

  // Replaces what `publisher` published before. How many are held (those with a namespace, up to the
  // bound): the descriptors the publisher's budget pays for.
  size_t publish(const void* publisher, std::vector<SharedRoute> routes);
  // Closes what `publisher` published. Nothing if it published nothing.
  void withdraw(const void* publisher);
  // A copy of a route published for `key` (its namespace a new descriptor, or none without
  // `with_namespace`), if any publisher has one.
  std::optional<SharedRoute> find(std::string_view key, bool with_namespace = true) const;
  size_t size() const;

 private:
  mutable std::mutex mu_;
  // Per publisher (a few: one per worker), by key.
  std::unordered_map<const void*, std::unordered_map<std::string, SharedRoute>> by_publisher_;
};

}  // namespace sg
