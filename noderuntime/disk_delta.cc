#include "noderuntime/disk_delta.h"

#include <unistd.h>

#include <charconv>
#include <fstream>

#include "snapshot/layer_store.h"
#include "snapshot/snapshot_store.h"

namespace sg {
namespace {

// QEMU's answers are the peer's: read field by field, a wrong type reads as absent.
const nlohmann::json* field(const nlohmann::json& j, const char* key) {
  if (!j.is_object()) return nullptr;
  auto it = j.find(key);
  return it == j.end() ? nullptr : &*it;
}

std::string string_field(const nlohmann::json& j, const char* key) {
  const nlohmann::json* f = field(j, key);
  return f != nullptr && f->is_string() ? f->get<std::string>() : std::string();
}

bool bool_field(const nlohmann::json& j, const char* key) {
  const nlohmann::json* f = field(j, key);
  return f != nullptr && f->is_boolean() && f->get<bool>();
}

// A chain longer than this is damaged (a loop of backing files): the walk stops.
constexpr size_t kMaxChainWalk = 4096;

}  // namespace

std::optional<LastDiskCheckpoint> read_last_disk_checkpoint(const std::string& sandbox_dir) {
  std::ifstream in(sandbox_dir + "/" + kDiskCheckpointMarker);
  LastDiskCheckpoint last;
  std::string chain;
  if (!std::getline(in, last.id) || !std::getline(in, last.disk) || !std::getline(in, chain)) return std::nullopt;
  if (!snapshot::check_snapshot_id(last.id) || !last.disk.starts_with("/")) return std::nullopt;
  auto [end, ec] = std::from_chars(chain.data(), chain.data() + chain.size(), last.chain);
  if (ec != std::errc() || end != chain.data() + chain.size() || last.chain == 0) return std::nullopt;
  return last;
}

Status write_last_disk_checkpoint(const std::string& sandbox_dir, const LastDiskCheckpoint& last) {
  return snapshot::write_file_atomic(sandbox_dir + "/" + kDiskCheckpointMarker,
                                     last.id + "\n" + last.disk + "\n" + std::to_string(last.chain) + "\n");
}

Result<DiskDeltaPlan> plan_disk_delta(const nlohmann::json& nodes, const std::string& overlay,
                                      const std::optional<LastDiskCheckpoint>& last, uint32_t max_chain) {
  const nlohmann::json* node = nullptr;
  if (nodes.is_array())
    for (const nlohmann::json& n : nodes) {
      const nlohmann::json* image = field(n, "image");
      if (string_field(n, "drv") == "qcow2" && image != nullptr && string_field(*image, "filename") == overlay)
        node = &n;
    }
  if (node == nullptr) return fail(Error::kInternal, "QEMU lists no qcow2 node for the disk " + overlay);
  const nlohmann::json& image = *field(*node, "image");
  DiskDeltaPlan plan;
  const nlohmann::json* size = field(image, "virtual-size");
  if (size == nullptr || !size->is_number_integer() || size->get<int64_t>() <= 0)
    return fail(Error::kInternal, "QEMU gives no size for the disk " + overlay);
  plan.virtual_size = static_cast<uint64_t>(size->get<int64_t>());
  plan.backing = string_field(image, "full-backing-filename");
  if (plan.backing.empty()) plan.backing = string_field(image, "backing-filename");
  plan.backing_format = string_field(image, "backing-filename-format");
  if (plan.backing.empty() || (plan.backing_format != "raw" && plan.backing_format != "qcow2"))
    return fail(Error::kInternal, "QEMU gives no backing file (raw or qcow2) for the disk " + overlay);

  bool base_bitmap = false;
  if (const nlohmann::json* bitmaps = field(*node, "dirty-bitmaps"); bitmaps != nullptr && bitmaps->is_array())
    for (const nlohmann::json& b : *bitmaps) {
      const std::string name = string_field(b, "name");
      if (!name.starts_with("snap-")) continue;  // not ours
      // A bitmap of a QEMU that was killed is inconsistent: the writes it missed are unknown.
      if (last && name == last->id && !bool_field(b, "inconsistent")) base_bitmap = true;
      else plan.stale_bitmaps.push_back(name);
    }
  // The overlay's backing chain, node by node (each format node's backing file is the next one's file).
  std::vector<const nlohmann::json*> below;
  for (std::string next = plan.backing; !next.empty() && below.size() <= kMaxChainWalk;) {
    const nlohmann::json* found = nullptr;
    if (nodes.is_array())
      for (const nlohmann::json& n : nodes) {
        const nlohmann::json* image = field(n, "image");
        if (image != nullptr && string_field(n, "drv") != "file" && string_field(*image, "filename") == next) found = &n;
      }
    if (found == nullptr) break;
    below.push_back(found);
    const nlohmann::json& image = *field(*found, "image");
    next = string_field(image, "full-backing-filename");
    if (next.empty()) next = string_field(image, "backing-filename");
  }

  if (base_bitmap && ::access(last->disk.c_str(), R_OK) == 0 && last->chain < max_chain) {
    plan.base_id = last->id;
    plan.backing = last->disk;
    plan.backing_format = "qcow2";
    plan.chain = last->chain + 1;
  } else if (base_bitmap) {
    plan.stale_bitmaps.push_back(last->id);  // its snapshot is gone, or its chain full: nothing starts from it
  }
  // The disks under the overlay, all but the bottom (the image's base) being snapshots': as many as the bound,
  // and the whole copy would start the new snapshot's chain on all of them.
  if (!plan.delta() && below.size() > 1 && below.size() - 1 >= max_chain) {
    const nlohmann::json& bottom = *below.back();
    plan.stream_base_node = string_field(bottom, "node-name");
    plan.backing = string_field(*field(bottom, "image"), "filename");
    plan.backing_format = string_field(bottom, "drv");
    if (plan.stream_base_node.empty() || (plan.backing_format != "raw" && plan.backing_format != "qcow2"))
      return fail(Error::kInternal, "QEMU names no node for the bottom of the disk chain under " + overlay);
  }
  return plan;
}

nlohmann::json disk_stream_arguments(const DiskDeltaPlan& plan) {
  return {{"job-id", kCheckpointNode}, {"device", "root"}, {"base-node", plan.stream_base_node}, {"auto-dismiss", false}};
}

nlohmann::json disk_delta_transaction(const DiskDeltaPlan& plan, const std::string& new_id) {
  nlohmann::json backup = {{"device", "root"},
                           {"target", kCheckpointNode},
                           {"job-id", kCheckpointNode},
                           {"auto-dismiss", false}};
  if (plan.delta()) {
    // `never`: the base's bitmap stays as it is whatever happens; the new one took over at this point.
    backup["sync"] = "bitmap";
    backup["bitmap"] = plan.base_id;
    backup["bitmap-mode"] = "never";
  } else {
    backup["sync"] = "top";
  }
  return {{"actions",
           nlohmann::json::array(
               {{{"type", "block-dirty-bitmap-add"}, {"data", {{"node", "root"}, {"name", new_id}, {"persistent", true}}}},
                {{"type", "blockdev-backup"}, {"data", std::move(backup)}}})}};
}

Result<BackupJob> backup_job_state(const nlohmann::json& jobs) {
  if (!jobs.is_array()) return fail(Error::kInternal, "QEMU's query-jobs answer is not a list");
  for (const nlohmann::json& job : jobs) {
    if (string_field(job, "id") != kCheckpointNode) continue;
    const std::string status = string_field(job, "status");
    if (status != "concluded" && status != "null") return BackupJob::kRunning;
    if (std::string error = string_field(job, "error"); !error.empty())
      return fail(Error::kIo, "the disk's checkpoint job failed: " + error);
    return BackupJob::kConcluded;
  }
  return BackupJob::kAbsent;
}

}  // namespace sg
