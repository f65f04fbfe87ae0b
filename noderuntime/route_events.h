// Route-cache invalidations for the proxies (Node::subscribe) and the stamps that order them against opens.
// A proxy caches routes to running sandboxes; whatever makes such a route wrong (a sandbox leaving
// `running`, a new token, changed ports, a new operator token) is published here, synchronously, before the
// call that caused it answers. Stamps are strictly increasing within this process and, as wall-clock
// microseconds, across restarts of the node, so a proxy can order an open against a later event without
// sharing a clock with the node.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>

namespace sg {

// What a proxy's route cache must forget: a sandbox that stops running, gets a new token or changes its
// ports (`id` set), or the operator token changed (`id` empty: every entry). `stamp` orders it against
// opens: an open answered before it (opened_at < stamp) must not be cached after it.
struct RouteEvent {
  std::string id;
  std::string name;    // empty for unnamed sandboxes
  std::string reason;  // "suspending", "terminating", "failed", "token", "operator_token", "ports"
  uint64_t stamp = 0;
};

class RouteEvents {
 public:
  using Listener = std::function<void(const RouteEvent&)>;

  // Returns the id unsubscribe() takes. A listener may unsubscribe (itself or others) while it runs.
  uint64_t subscribe(Listener listener);
  void unsubscribe(uint64_t subscription);
  size_t subscribers() const { return listeners_.size(); }

  // Strictly increasing across calls and (as wall-clock microseconds) across restarts.
  uint64_t stamp();
  // Tells every listener, in subscription order, with a stamp taken now. No listener: no stamp taken.
  void publish(std::string id, std::string name, std::string reason);

 private:
  uint64_t last_stamp_ = 0;
  std::map<uint64_t, Listener> listeners_;
  uint64_t next_subscription_ = 1;
};

}  // namespace sg
