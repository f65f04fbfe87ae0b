#include "proxy/port_policy_cache.h"

#include <iterator>

namespace sg {

std::string PortPolicyCache::key(std::string_view sandbox_ref, uint16_t port) {
  std::string k(sandbox_ref);
  k += ':';
  k += std::to_string(port);
  return k;
}

std::optional<PortPolicy> PortPolicyCache::find(std::string_view sandbox_ref, uint16_t port, uint64_t now_ms) {
  auto it = entries_.find(key(sandbox_ref, port));
  if (it == entries_.end()) return std::nullopt;
  if (now_ms >= it->second.expires_ms) {
    entries_.erase(it);
    return std::nullopt;
  }
  return it->second.policy;
}

void PortPolicyCache::store(std::string_view sandbox_ref, uint16_t port, PortPolicy policy, uint64_t now_ms) {
  if (ttl_ms_ == 0 || max_entries_ == 0) return;
  std::string k = key(sandbox_ref, port);
  if (entries_.size() >= max_entries_ && !entries_.contains(k)) entries_.clear();
  entries_[std::move(k)] = Entry{std::move(policy), now_ms + ttl_ms_};
}

void PortPolicyCache::erase(std::string_view sandbox_ref, uint16_t port) { entries_.erase(key(sandbox_ref, port)); }

void PortPolicyCache::erase_sandbox(std::string_view sandbox_id) {
  std::erase_if(entries_, [&](const auto& e) { return e.second.policy.sandbox_id == sandbox_id; });
}

}  // namespace sg
