// The node's live sandboxes, by id and by name (names are unique on a node; a fleet also claims them in
// etcd). Lookups by "ref" accept either. Nothing here talks to a driver or the store.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/error.h"
#include "config/config.h"
#include "noderuntime/live_sandbox.h"

namespace sg {

// What the sandboxes of a node reserve in all: each its spec's memory_mb and cpus while it may run, suspended
// and hibernated included (it may be woken at any moment); a failed one, which cannot, holds none.
// Written on the node's loop, read from any thread (the fleet's lease thread publishes it).
struct Reservations {
  std::atomic<uint64_t> memory_mb{0};
  std::atomic<uint64_t> millicpus{0};
};

// cpus as the reservations count them.
uint64_t millicpus(double cpus);

// Whether a sandbox of `spec` fits beside what is `reserved` within node.max_memory_mb and node.max_cpus
// (0: no limit); kLimitExceeded (429, which fleet placement takes as "try another node") saying which not.
Status reservation_fits(const Reservations& reserved, const NodeConfig& node, const SandboxSpec& spec);

class SandboxRegistry {
 public:
  // By id or name; null when unknown.
  LiveSandbox* find(std::string_view ref) const;
  // By id only; null when unknown.
  LiveSandbox* by_id(const std::string& id) const;
  // find(), and kNotFound for an unknown sandbox or one whose removal is in flight.
  Result<LiveSandbox*> find_usable(std::string_view ref) const;
  // The id of the sandbox called `name` here, or null.
  const std::string* id_of(const std::string& name) const;
  bool contains(const std::string& id) const { return by_id_.count(id) != 0; }
  size_t size() const { return by_id_.size(); }
  // Every sandbox, in no particular order (stable while nothing is added or erased).
  std::vector<LiveSandbox*> all() const;

  // Shared, so a reader on another thread may outlive the registry.
  std::shared_ptr<const Reservations> reservations() const { return reservations_; }

  // Takes a sandbox whose id is new here; its name, if any, becomes taken.
  LiveSandbox& add(std::unique_ptr<LiveSandbox> sandbox);
  // The sandbox failed: it will not run again, and its reservation goes (once).
  void release_reservation(LiveSandbox& sandbox);
  // Drops the sandbox (no-op for an unknown id); references to it dangle from here on.
  void erase(const std::string& id);

  // An id no sandbox here has.
  std::string new_id() const;
  // The lowest uid range (`range_base` + slot * kUidRangeSize) no sandbox here holds.
  Result<uint32_t> free_uid_base(uint32_t range_base) const;

 private:
  std::unordered_map<std::string, std::unique_ptr<LiveSandbox>> by_id_;
  // Every sandbox's spec.uid_base, sorted, so a create walks to the first free range instead of collecting
  // them all (which made 10,000 creates take 55 s). A multiset: records from an older node may share one.
  std::multiset<uint32_t> uid_bases_;
  // No range below slot `free_from_slot_` of `free_from_base_` is free: creates take the lowest free range and
  // only a removal frees one (and lowers it), so a create usually steps over one base, not all of them.
  mutable uint32_t free_from_base_ = 0;
  mutable uint64_t free_from_slot_ = 0;
  std::unordered_map<std::string, std::string> ids_by_name_;
  std::shared_ptr<Reservations> reservations_ = std::make_shared<Reservations>();
};

}  // namespace sg
