#include "proxy/traffic.h"

#include <string_view>

#include "common/json_text.h"

namespace sg {

SandboxTraffic* WorkerTraffic::open_connection(const std::string& sandbox_id) {
  SandboxTraffic& t = by_sandbox_[sandbox_id];
  ++t.connections;
  t.reported_connections_dirty = true;
  return &t;
}

void WorkerTraffic::close_connection(const std::string& sandbox_id) {
  auto it = by_sandbox_.find(sandbox_id);
  if (it == by_sandbox_.end() || it->second.connections == 0) return;
  --it->second.connections;
  it->second.reported_connections_dirty = true;
}

std::string WorkerTraffic::take_report(const std::string& reporter) {
  // Written directly, not through a JSON tree: a worker with 10,000 active sandboxes sends this every
  // second (bench/RESULTS.md). The reporter is named once for all entries.
  std::string body;
  body.reserve(64 + by_sandbox_.size() * 80);
  body += "{\"reporter\":";
  append_json_string(body, reporter);
  body += ",\"sandboxes\":[";
  bool any = false;
  for (auto it = by_sandbox_.begin(); it != by_sandbox_.end();) {
    SandboxTraffic& t = it->second;
    // Open connections are re-asserted in every report: the node forgets a reporter's counts once it has
    // been silent for a while (a crashed proxy must not hold sandboxes awake forever).
    if (t.bytes_in != 0 || t.bytes_out != 0 || t.reported_connections_dirty || t.connections > 0) {
      body += any ? ",{\"id\":" : "{\"id\":";
      any = true;
      append_json_string(body, it->first);
      body += ",\"bytes_in\":";
      append_json_number(body, t.bytes_in);
      body += ",\"bytes_out\":";
      append_json_number(body, t.bytes_out);
      body += ",\"connections\":";
      append_json_number(body, t.connections);
      body += '}';
      reported_.bytes_in += t.bytes_in;
      reported_.bytes_out += t.bytes_out;
      t.bytes_in = t.bytes_out = 0;
      t.reported_connections_dirty = false;
    }
    if (t.connections == 0) {
      it = by_sandbox_.erase(it);
    } else {
      ++it;
    }
  }
  if (!any) return {};
  body += "]}";
  return body;
}

bool ConnectionLimits::try_acquire(const std::string& key, uint32_t limit) {
  std::lock_guard lock(mu_);
  uint32_t& n = open_[key];
  if (n >= limit) return false;
  ++n;
  return true;
}

void ConnectionLimits::release(const std::string& key) {
  std::lock_guard lock(mu_);
  auto it = open_.find(key);
  if (it == open_.end()) return;
  if (--it->second == 0) open_.erase(it);
}

uint32_t ConnectionLimits::count(const std::string& key) const {
  std::lock_guard lock(mu_);
  auto it = open_.find(key);
  return it == open_.end() ? 0 : it->second;
}

}  // namespace sg
