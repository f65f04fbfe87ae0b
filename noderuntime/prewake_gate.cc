#include "noderuntime/prewake_gate.h"

#include <algorithm>

namespace sg {

void PrewakeGate::verified(std::string_view id, std::string_view client, Clock::time_point now) {
  if (client.empty()) return;
  std::vector<Seen>& seen = seen_[std::string(id)];
  auto same = std::find_if(seen.begin(), seen.end(), [&](const Seen& s) { return s.client == client; });
  if (same != seen.end()) {
    same->at = now;
  } else if (seen.size() < kMaxClientsPerSandbox) {
    seen.push_back({std::string(client), now});
  } else {
    auto oldest = std::min_element(seen.begin(), seen.end(), [](const Seen& a, const Seen& b) { return a.at < b.at; });
    *oldest = {std::string(client), now};
  }
}

bool PrewakeGate::admits(std::string_view id, std::string_view client, Clock::time_point now,
                         std::chrono::seconds window) const {
  if (client.empty() || window.count() <= 0) return false;
  auto it = seen_.find(std::string(id));
  if (it == seen_.end()) return false;
  return std::any_of(it->second.begin(), it->second.end(),
                     [&](const Seen& s) { return s.client == client && now - s.at <= window; });
}

void PrewakeGate::forget(std::string_view id) { seen_.erase(std::string(id)); }

}  // namespace sg
