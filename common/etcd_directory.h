// sg::fleet::Directory kept from etcd: one thread lists /sandgate/ and then watches it from the list's
// revision, applying every event to an in-memory view that the readers (proxy workers, nodes) query under a
// shared lock. A compacted watch (the view fell too far behind) or a broken stream (the member died; the
// client then tries the next member) marks the view not current() and lists again.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <thread>

#include "common/etcd_client.h"
#include "common/fleet_directory.h"
#include "common/fleet_keys.h"

namespace sg::fleet {

class EtcdDirectory : public Directory {
 public:
  explicit EtcdDirectory(etcd::ClientOptions options);
  ~EtcdDirectory() override;
  EtcdDirectory(const EtcdDirectory&) = delete;
  EtcdDirectory& operator=(const EtcdDirectory&) = delete;

  void start();
  void stop();

  std::optional<SandboxOwner> owner_of(std::string_view sandbox) const override;
  std::optional<NodeInfo> node(std::string_view name) const override;
  std::vector<NodeInfo> nodes() const override;
  bool current() const override { return current_.load(); }

  // Tests: runs on the directory's thread after each list, before its watch starts (the window in which a
  // compaction makes the watch start compacted). Set before start().
  void set_between_list_and_watch(std::function<void()> hook) { between_list_and_watch_ = std::move(hook); }

  // How many times the view was listed from scratch (the first list included): for tests and metrics.
  uint64_t lists() const { return lists_.load(); }
  // The etcd revision the view reflects.
  int64_t revision() const { return revision_.load(); }

 private:
  void run();
  Status relist();
  void apply(const etcd::WatchEvent& event);
  void apply_put(const std::string& key, const std::string& value);
  void apply_delete(const std::string& key);

  etcd::Client client_;
  mutable std::shared_mutex mu_;
  std::map<std::string, NodeInfo, std::less<>> nodes_;
  struct Owner {
    std::string node;
    std::shared_ptr<const std::vector<PortRoute>> ports;
  };
  static Owner owner_from(SandboxRecord rec);
  std::map<std::string, Owner, std::less<>> owners_;  // sandbox -> its node and ports

  std::atomic<bool> current_{false};
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> lists_{0};
  std::atomic<int64_t> revision_{0};
  std::mutex watch_mu_;
  etcd::Watch* watch_ = nullptr;  // the stream run() reads, for stop() to cancel
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  std::thread thread_;
  std::function<void()> between_list_and_watch_;
};

}  // namespace sg::fleet
