#include "noderuntime/sandbox_registry.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

#include "noderuntime/names.h"
#include "noderuntime/sandbox.h"

namespace sg {

uint64_t millicpus(double cpus) {
  // A create's cpus are checked later (make_sandbox_spec); placement reads them unchecked.
  if (!(cpus > 0)) return 0;
  return static_cast<uint64_t>(std::llround(std::min(cpus, 1e12) * 1000));
}

Status reservation_fits(const Reservations& reserved, const NodeConfig& node, const SandboxSpec& spec) {
  const uint64_t memory = reserved.memory_mb.load();
  if (node.max_memory_mb != 0 && memory + spec.memory_mb > node.max_memory_mb)
    return fail(Error::kLimitExceeded, "memory_mb: " + std::to_string(spec.memory_mb) + " MiB do not fit on this node (" +
                                           std::to_string(memory) + " of its " + std::to_string(node.max_memory_mb) +
                                           " MiB are reserved, node.max_memory_mb)");
  const uint64_t cpus = reserved.millicpus.load();
  if (node.max_cpus != 0 && cpus + millicpus(spec.cpus) > uint64_t{node.max_cpus} * 1000) {
    auto cores = [](uint64_t milli) {
      char text[32];
      std::snprintf(text, sizeof text, "%g", static_cast<double>(milli) / 1000);
      return std::string(text);
    };
    return fail(Error::kLimitExceeded, "cpus: " + cores(millicpus(spec.cpus)) + " do not fit on this node (" +
                                           cores(cpus) + " of its " + std::to_string(node.max_cpus) +
                                           " are reserved, node.max_cpus)");
  }
  return {};
}

LiveSandbox* SandboxRegistry::find(std::string_view ref) const {
  std::string key(ref);
  if (!looks_like_id(ref)) {
    auto named = ids_by_name_.find(key);
    if (named == ids_by_name_.end()) return nullptr;
    key = named->second;
  }
  auto it = by_id_.find(key);
  return it == by_id_.end() ? nullptr : it->second.get();
}

LiveSandbox* SandboxRegistry::by_id(const std::string& id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second.get();
}

Result<LiveSandbox*> SandboxRegistry::find_usable(std::string_view ref) const {
  LiveSandbox* sb = find(ref);
  if (sb == nullptr) return fail(Error::kNotFound, "no sandbox '" + std::string(ref) + "'");
  if (sb->terminating) return fail(Error::kNotFound, "sandbox " + sb->id() + " is being terminated");
  return sb;
}

const std::string* SandboxRegistry::id_of(const std::string& name) const {
  auto it = ids_by_name_.find(name);
  return it == ids_by_name_.end() ? nullptr : &it->second;
}

std::vector<LiveSandbox*> SandboxRegistry::all() const {
  std::vector<LiveSandbox*> out;
  out.reserve(by_id_.size());
  for (const auto& [id, sb] : by_id_) out.push_back(sb.get());
  return out;
}

LiveSandbox& SandboxRegistry::add(std::unique_ptr<LiveSandbox> sandbox) {
  LiveSandbox& sb = *sandbox;
  if (!sb.name().empty()) ids_by_name_[sb.name()] = sb.id();
  sb.reserves = sb.rec.state != SandboxState::kFailed && sb.rec.state != SandboxState::kTerminated;
  if (sb.reserves) {
    reservations_->memory_mb += sb.rec.spec.memory_mb;
    reservations_->millicpus += millicpus(sb.rec.spec.cpus);
  }
  uid_bases_.insert(sb.rec.spec.uid_base);
  by_id_[sb.id()] = std::move(sandbox);
  return sb;
}

void SandboxRegistry::release_reservation(LiveSandbox& sb) {
  if (!sb.reserves) return;
  sb.reserves = false;
  reservations_->memory_mb -= sb.rec.spec.memory_mb;
  reservations_->millicpus -= millicpus(sb.rec.spec.cpus);
}

void SandboxRegistry::erase(const std::string& id) {
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return;
  auto named = ids_by_name_.find(it->second->name());
  if (named != ids_by_name_.end() && named->second == id) ids_by_name_.erase(named);
  release_reservation(*it->second);
  const uint32_t uid_base = it->second->rec.spec.uid_base;
  if (auto base = uid_bases_.find(uid_base); base != uid_bases_.end()) uid_bases_.erase(base);
  if (uid_base >= free_from_base_ && (uid_base - free_from_base_) % kUidRangeSize == 0)
    free_from_slot_ = std::min<uint64_t>(free_from_slot_, (uid_base - free_from_base_) / kUidRangeSize);
  by_id_.erase(it);
}

std::string SandboxRegistry::new_id() const {
  std::string id;
  do {
    id = generate_id();
  } while (by_id_.count(id) != 0);
  return id;
}

Result<uint32_t> SandboxRegistry::free_uid_base(uint32_t range_base) const {
  const uint64_t slots = ((uint64_t{1} << 32) - 1 - range_base) / kUidRangeSize;
  const uint64_t end = uint64_t{range_base} + slots * kUidRangeSize;
  if (range_base != free_from_base_) {
    free_from_base_ = range_base;
    free_from_slot_ = 0;
  }
  // The sorted bases from there up: the first slot base not among them is free. Bases between slots (made
  // under another node.uid_range_base) do not hold a slot, as before.
  uint64_t candidate = uint64_t{range_base} + free_from_slot_ * kUidRangeSize;
  if (candidate < end) {
    for (auto it = uid_bases_.lower_bound(static_cast<uint32_t>(candidate)); it != uid_bases_.end() && *it <= candidate;
         ++it)
      if (*it == candidate) candidate += kUidRangeSize;
  }
  free_from_slot_ = (candidate - range_base) / kUidRangeSize;
  if (candidate < end) return static_cast<uint32_t>(candidate);
  return fail(Error::kLimitExceeded,
              "every uid range above node.uid_range_base is in use (" + std::to_string(slots) + " sandboxes)");
}

}  // namespace sg
