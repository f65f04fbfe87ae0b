#include "snapshot/snapshot_store.h"

#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "common/fd.h"
#include "snapshot/layer_store.h"

namespace sg::snapshot {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

constexpr std::string_view kPrefix = "snap-";
constexpr size_t kRandomChars = 12;
constexpr std::string_view kAlphabet = "abcdefghijklmnopqrstuvwxyz0123456789";

ordered_json to_json(const Snapshot& s) {
  ordered_json ports = ordered_json::array();
  for (const SnapshotPort& p : s.ports)
    ports.push_back({{"port", p.port}, {"public", p.is_public}, {"protocol", p.protocol}});
  ordered_json j{{"id", s.id},
                      {"type", s.type},
                      {"source_id", s.source_id},
                      {"source_name", s.source_name},
                      {"driver", s.driver},
                      {"image", s.image},
                      {"layers", s.layers},
                      {"layer", s.layer},
                      {"layer_bytes", s.layer_bytes},
                      {"command", s.command},
                      {"env", s.env},
                      {"cwd", s.cwd},
                      {"ports", std::move(ports)},
                      {"created_at_ms", s.created_at_ms},
                      {"memory_mb", s.memory_mb},
                      {"cpus", s.cpus},
                      {"state_bytes", s.state_bytes},
                      {"ram_bytes", s.ram_bytes},
                      {"disk_bytes", s.disk_bytes},
                      {"parent", s.parent},
                      {"file_digests", s.file_digests}};
  if (s.removed) j["removed"] = true;
  return j;
}

// The node's own file; parsed defensively all the same (a disk can be edited or damaged).
Result<Snapshot> from_json(const std::string& text, const std::string& where) {
  json j = json::parse(text, nullptr, false);
  auto bad = [&](std::string_view field) {
    return fail(Error::kIo, where + ": damaged snapshot record (field " + std::string(field) + ")");
  };
  if (!j.is_object()) return bad("<root>");
  auto str = [&](const char* key, std::string& out) {
    auto it = j.find(key);
    if (it == j.end() || !it->is_string()) return false;
    out = it->get<std::string>();
    return true;
  };
  auto strings = [&](const char* key, std::vector<std::string>& out) {
    auto it = j.find(key);
    if (it == j.end() || !it->is_array()) return false;
    for (const json& v : *it) {
      if (!v.is_string()) return false;
      out.push_back(v.get<std::string>());
    }
    return true;
  };
  Snapshot s;
  for (auto [key, out] : {std::pair{"id", &s.id}, std::pair{"type", &s.type}, std::pair{"source_id", &s.source_id},
                          std::pair{"source_name", &s.source_name}, std::pair{"driver", &s.driver},
                          std::pair{"image", &s.image}, std::pair{"layer", &s.layer}, std::pair{"cwd", &s.cwd}})
    if (!str(key, *out)) return bad(key);
  if (!strings("layers", s.layers)) return bad("layers");
  for (const std::string& d : s.layers)
    if (!valid_digest(d)) return bad("layers");
  if (!strings("command", s.command)) return bad("command");
  auto env = j.find("env");
  if (env == j.end() || !env->is_object()) return bad("env");
  for (auto it = env->begin(); it != env->end(); ++it) {
    if (!it.value().is_string()) return bad("env");
    s.env[it.key()] = it.value().get<std::string>();
  }
  auto ports = j.find("ports");
  if (ports == j.end() || !ports->is_array()) return bad("ports");
  for (const json& p : *ports) {
    if (!p.is_object() || !p.contains("port") || !p["port"].is_number_unsigned() || p["port"].get<uint64_t>() < 1 ||
        p["port"].get<uint64_t>() > 65535 || !p.contains("public") || !p["public"].is_boolean() ||
        !p.contains("protocol") || !p["protocol"].is_string())
      return bad("ports");
    s.ports.push_back({static_cast<uint16_t>(p["port"].get<uint64_t>()), p["public"].get<bool>(),
                       p["protocol"].get<std::string>()});
  }
  auto bytes = j.find("layer_bytes");
  if (bytes == j.end() || !bytes->is_number_unsigned()) return bad("layer_bytes");
  s.layer_bytes = bytes->get<uint64_t>();
  auto created = j.find("created_at_ms");
  if (created == j.end() || !created->is_number_integer()) return bad("created_at_ms");
  s.created_at_ms = created->get<int64_t>();
  // Added with memory snapshots; a filesystem record written before has none.
  for (auto [key, out] : {std::pair{"state_bytes", &s.state_bytes}, std::pair{"ram_bytes", &s.ram_bytes},
                          std::pair{"disk_bytes", &s.disk_bytes}}) {
    auto it = j.find(key);
    if (it == j.end()) continue;
    if (!it->is_number_unsigned()) return bad(key);
    *out = it->get<uint64_t>();
  }
  if (auto it = j.find("memory_mb"); it != j.end()) {
    if (!it->is_number_unsigned() || it->get<uint64_t>() > UINT32_MAX) return bad("memory_mb");
    s.memory_mb = it->get<uint32_t>();
  }
  if (auto it = j.find("cpus"); it != j.end()) {
    if (!it->is_number() || it->get<double>() < 0 || it->get<double>() > 1024) return bad("cpus");
    s.cpus = it->get<double>();
  }
  if (auto it = j.find("file_digests"); it != j.end()) {  // added with the digests of memory snapshots
    if (!it->is_object() || it->size() > 8) return bad("file_digests");
    for (const auto& [name, digest] : it->items()) {
      // Plain names inside the snapshot's own directory only: a damaged record must not point elsewhere.
      if (name.empty() || name.size() > 64 || name.find('/') != std::string::npos || name == "." || name == ".." ||
          !digest.is_string() || !valid_digest(digest.get<std::string>()))
        return bad("file_digests");
      s.file_digests[name] = digest.get<std::string>();
    }
  }
  if (auto it = j.find("parent"); it != j.end()) {  // added with the disk checkpoints of VMs
    if (!it->is_string() || (!it->get<std::string>().empty() && !check_snapshot_id(it->get<std::string>())))
      return bad("parent");
    s.parent = it->get<std::string>();
  }
  if (auto it = j.find("removed"); it != j.end()) {  // added with the disk deltas of VM checkpoints
    if (!it->is_boolean()) return bad("removed");
    s.removed = it->get<bool>();
  }
  if (s.type != "filesystem" && s.type != "memory") return bad("type");
  if (s.type == "memory" && (s.memory_mb == 0 || s.cpus <= 0)) return bad("memory_mb");
  if (!check_snapshot_id(s.id)) return bad("id");
  return s;
}

}  // namespace

Status check_snapshot_id(std::string_view id) {
  bool ok = id.size() == kPrefix.size() + kRandomChars && id.starts_with(kPrefix);
  for (char c : id.substr(std::min(id.size(), kPrefix.size())))
    ok = ok && kAlphabet.find(c) != std::string_view::npos;
  if (!ok)
    return fail(Error::kInvalidArgument, "invalid snapshot id '" + std::string(id.substr(0, 64)) +
                                             "': snap- followed by 12 of a-z 0-9");
  return {};
}

std::string generate_snapshot_id() {
  // Rejection sampling keeps every character equally likely: 252 = 7 * 36 is the largest multiple below 256.
  constexpr uint8_t kUnbiasedLimit = 252;
  std::string id(kPrefix);
  while (id.size() < kPrefix.size() + kRandomChars) {
    uint8_t buf[32];
    ssize_t n = ::getrandom(buf, sizeof buf, 0);
    for (ssize_t i = 0; i < n && id.size() < kPrefix.size() + kRandomChars; ++i)
      if (buf[i] < kUnbiasedLimit) id += kAlphabet[buf[i] % kAlphabet.size()];
  }
  return id;
}

Result<SnapshotStore> SnapshotStore::open(const std::string& root) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return fail(Error::kIo, "create " + root + ": " + ec.message());
  // write_file_atomic's temp files (".<name>.tmp-XXXXXX") of a write a crash interrupted, a memory
  // checkpoint's files still being written (".d.tmp"), and files whose record never came or already went.
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    std::string name = entry.path().filename().string();
    std::error_code ignored;
    if (name.starts_with(".") && name.find(".tmp-") != std::string::npos) fs::remove(entry.path(), ignored);
    if (name.ends_with(".d.tmp")) fs::remove_all(entry.path(), ignored);
    if (name.ends_with(".d") && !fs::exists(root + "/" + name.substr(0, name.size() - 2) + ".json", ignored))
      fs::remove_all(entry.path(), ignored);
  }
  if (ec) return fail(Error::kIo, "read " + root + ": " + ec.message());
  SnapshotStore store(root);
  // Removed snapshots whose last child went, but a crash came before they went with it.
  for (bool again = true; again;) {
    again = false;
    auto all = store.list();
    if (!all) break;  // a damaged record might be a child: keep them all
    std::set<std::string> parents;
    for (const Snapshot& s : *all) parents.insert(s.parent);
    for (const Snapshot& s : *all)
      if (s.removed && !parents.contains(s.id) && store.remove(s.id)) again = true;
  }
  return store;
}

Status SnapshotStore::create(const Snapshot& snapshot) {
  if (auto s = check_snapshot_id(snapshot.id); !s) return s;
  if (::access(file(snapshot.id).c_str(), F_OK) == 0)
    return fail(Error::kAlreadyExists, "snapshot " + snapshot.id + " already exists");
  auto all = list();
  if (!all) return all.failure();
  if (all->size() >= kMaxSnapshots)
    return fail(Error::kLimitExceeded, "this node already has " + std::to_string(all->size()) +
                                           " snapshots (the limit); remove some with `sandgate snapshot rm`");
  return write_file_atomic(file(snapshot.id), to_json(snapshot).dump(2) + "\n");
}

Result<Snapshot> SnapshotStore::get(std::string_view id) const {
  if (auto s = check_snapshot_id(id); !s) return s.failure();
  std::string path = file(id);
  int raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (raw < 0) {
    if (errno == ENOENT) return fail(Error::kNotFound, "no snapshot " + std::string(id));
    return fail_errno("open " + path, errno);
  }
  UniqueFd fd(raw);
  auto text = read_at_most(fd.get(), kMaxSnapshotRecordBytes, path);
  if (!text) return text.failure();
  auto snapshot = from_json(*text, path);
  if (snapshot && snapshot->id != id) return fail(Error::kIo, path + ": the record names " + snapshot->id);
  return snapshot;
}

Result<std::vector<Snapshot>> SnapshotStore::list() const {
  std::vector<Snapshot> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root_, ec)) {
    std::string name = entry.path().filename().string();
    if (name.starts_with(".") || !name.ends_with(".json")) continue;  // a write in progress
    auto s = get(name.substr(0, name.size() - 5));
    if (!s) return s.failure();
    out.push_back(std::move(*s));
  }
  if (ec) return fail(Error::kIo, "read " + root_ + ": " + ec.message());
  std::sort(out.begin(), out.end(), [](const Snapshot& a, const Snapshot& b) {
    return a.created_at_ms != b.created_at_ms ? a.created_at_ms < b.created_at_ms : a.id < b.id;
  });
  return out;
}

Status SnapshotStore::remove(std::string_view id) {
  if (auto s = check_snapshot_id(id); !s) return s;
  if (::unlink(file(id).c_str()) != 0) {
    if (errno == ENOENT) return fail(Error::kNotFound, "no snapshot " + std::string(id));
    return fail_errno("remove " + file(id), errno);
  }
  // Without the record nothing uses them; a crash before this leaves them to open()'s sweep.
  std::error_code ec;
  fs::remove_all(files_dir(id), ec);
  return fsync_dir(root_);
}

Status SnapshotStore::mark_removed(std::string_view id) {
  auto record = get(id);
  if (!record) return record.failure();
  record->removed = true;
  // Only its disk is read by its children: a memory snapshot's state and RAM go now.
  std::erase_if(record->file_digests, [](const auto& f) { return f.first != kDiskFile; });
  if (Status s = write_file_atomic(file(id), to_json(*record).dump(2) + "\n"); !s) return s;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(files_dir(id), ec))
    if (entry.path().filename() != kDiskFile) fs::remove_all(entry.path(), ec);
  return {};
}

Result<std::set<std::string>> SnapshotStore::layers_in_use() const {
  auto all = list();
  if (!all) return all.failure();
  std::set<std::string> used;
  for (const Snapshot& s : *all) used.insert(s.layers.begin(), s.layers.end());
  return used;
}

Result<std::optional<std::string>> SnapshotStore::first_child_of(std::string_view id) const {
  auto all = list();
  if (!all) return all.failure();
  for (const Snapshot& s : *all)
    if (s.parent == id) return std::optional<std::string>(s.id);
  return std::optional<std::string>();
}

Result<std::optional<std::string>> SnapshotStore::first_user_of_image(const std::string& image) const {
  auto all = list();
  if (!all) return all.failure();
  for (const Snapshot& s : *all)
    if (s.image == image)
      return std::optional<std::string>("snapshot " + s.id +
                                        (s.removed ? " (removed; kept while a later snapshot's disk reads it)" : ""));
  return std::optional<std::string>();
}

}  // namespace sg::snapshot
