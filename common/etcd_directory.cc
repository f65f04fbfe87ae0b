#include "common/etcd_directory.h"

#include <spdlog/spdlog.h>

#include "common/fleet_keys.h"

namespace sg::fleet {
namespace {

constexpr std::string_view kRoot = "/sandgate/";
// After a failed list or watch, before the next try (the client has already tried every member).
constexpr auto kRetryDelay = std::chrono::milliseconds(200);
// How long one read of the stream blocks before stop() is looked at again (cancel() also interrupts it).
constexpr auto kReadSlice = std::chrono::milliseconds(1000);

}  // namespace

EtcdDirectory::EtcdDirectory(etcd::ClientOptions options) : client_(std::move(options)) {}

EtcdDirectory::~EtcdDirectory() { stop(); }

void EtcdDirectory::start() {
  if (thread_.joinable()) return;
  thread_ = std::thread([this] { run(); });
}

void EtcdDirectory::stop() {
  stopping_ = true;
  {
    std::lock_guard lock(watch_mu_);
    if (watch_ != nullptr) watch_->cancel();
  }
  stop_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::optional<SandboxOwner> EtcdDirectory::owner_of(std::string_view sandbox) const {
  std::shared_lock lock(mu_);
  auto it = owners_.find(sandbox);
  if (it == owners_.end()) return std::nullopt;
  SandboxOwner owner{it->second.node, std::nullopt, it->second.ports};
  if (auto n = nodes_.find(it->second.node); n != nodes_.end()) owner.node_info = n->second;
  return owner;
}

EtcdDirectory::Owner EtcdDirectory::owner_from(SandboxRecord rec) {
  Owner o{std::move(rec.node), nullptr};
  if (!rec.ports.empty()) o.ports = std::make_shared<const std::vector<PortRoute>>(std::move(rec.ports));
  return o;
}

std::optional<NodeInfo> EtcdDirectory::node(std::string_view name) const {
  std::shared_lock lock(mu_);
  auto it = nodes_.find(name);
  if (it == nodes_.end()) return std::nullopt;
  return it->second;
}

std::vector<NodeInfo> EtcdDirectory::nodes() const {
  std::shared_lock lock(mu_);
  std::vector<NodeInfo> out;
  for (const auto& [name, info] : nodes_) out.push_back(info);
  return out;
}

Status EtcdDirectory::relist() {
  auto all = client_.range_prefix(kRoot);
  if (!all) return all.failure();
  std::map<std::string, NodeInfo, std::less<>> nodes;
  std::map<std::string, Owner, std::less<>> owners;
  for (const etcd::KeyValue& kv : all->kvs) {
    std::string_view key = kv.key;
    if (key.starts_with(kFleetNodesPrefix)) {
      if (auto info = parse_node_info(kv.value)) nodes[std::string(key.substr(kFleetNodesPrefix.size()))] = *info;
    } else if (key.starts_with(kFleetSandboxesPrefix)) {
      if (auto rec = parse_sandbox_owner(kv.value))
        owners[std::string(key.substr(kFleetSandboxesPrefix.size()))] = owner_from(std::move(*rec));
    }
  }
  {
    std::unique_lock lock(mu_);
    nodes_ = std::move(nodes);
    owners_ = std::move(owners);
  }
  revision_ = all->revision;
  lists_++;
  return {};
}

void EtcdDirectory::apply_put(const std::string& key, const std::string& value) {
  std::string_view k = key;
  if (k.starts_with(kFleetNodesPrefix)) {
    auto info = parse_node_info(value);
    if (!info) {
      spdlog::warn("fleet directory: ignoring {}: {}", key, info.message());
      return;
    }
    std::unique_lock lock(mu_);
    nodes_[std::string(k.substr(kFleetNodesPrefix.size()))] = std::move(*info);
  } else if (k.starts_with(kFleetSandboxesPrefix)) {
    auto rec = parse_sandbox_owner(value);
    if (!rec) {
      spdlog::warn("fleet directory: ignoring {}: {}", key, rec.message());
      return;
    }
    Owner owner = owner_from(std::move(*rec));
    std::unique_lock lock(mu_);
    owners_[std::string(k.substr(kFleetSandboxesPrefix.size()))] = std::move(owner);
  }
}

void EtcdDirectory::apply_delete(const std::string& key) {
  std::string_view k = key;
  std::unique_lock lock(mu_);
  if (k.starts_with(kFleetNodesPrefix)) {
    auto it = nodes_.find(k.substr(kFleetNodesPrefix.size()));
    if (it != nodes_.end()) nodes_.erase(it);
  } else if (k.starts_with(kFleetSandboxesPrefix)) {
    auto it = owners_.find(k.substr(kFleetSandboxesPrefix.size()));
    if (it != owners_.end()) owners_.erase(it);
  }
}

void EtcdDirectory::apply(const etcd::WatchEvent& event) {
  if (event.type == etcd::WatchEvent::Type::kDelete) apply_delete(event.kv.key);
  else apply_put(event.kv.key, event.kv.value);
}

void EtcdDirectory::run() {
  auto pause = [&] {
    std::unique_lock lock(stop_mu_);
    stop_cv_.wait_for(lock, kRetryDelay, [&] { return stopping_.load(); });
  };
  while (!stopping_) {
    current_ = false;
    if (Status s = relist(); !s) {
      spdlog::warn("fleet directory: cannot list {}: {}", kRoot, s.message());
      pause();
      continue;
    }
    if (between_list_and_watch_) between_list_and_watch_();
    auto watch = client_.watch(kRoot, etcd::prefix_end(kRoot), revision_.load() + 1);
    if (!watch) {
      spdlog::warn("fleet directory: cannot watch {}: {}", kRoot, watch.message());
      pause();
      continue;
    }
    {
      std::lock_guard lock(watch_mu_);
      watch_ = watch->get();
    }
    if (stopping_) break;
    current_ = true;
    for (;;) {
      auto batch = (*watch)->next(kReadSlice);
      if (stopping_) break;
      if (!batch) {
        spdlog::warn("fleet directory: watch broke, listing again: {}", batch.message());
        break;
      }
      if (batch->kind == etcd::WatchBatch::Kind::kCompacted) {
        spdlog::info("fleet directory: watch compacted at revision {}, listing again", batch->compact_revision);
        break;
      }
      for (const auto& e : batch->events) {
        apply(e);
        revision_ = std::max(revision_.load(), e.kv.mod_revision);
      }
    }
    current_ = false;
    {
      std::lock_guard lock(watch_mu_);
      watch_ = nullptr;
    }
  }
  current_ = false;
}

}  // namespace sg::fleet
