#include "snapshot/checkpoint_delta.h"

#include <dirent.h>
#include <sys/stat.h>

#include <time.h>

#include <algorithm>
#include <charconv>
#include <climits>

#include "snapshot/layer_store.h"

namespace sg::snapshot {
namespace {

constexpr std::string_view kMagic = "sandgate-checkpoint-index 1\n";
// No real file has it, so a racy entry never matches what the next scan sees.
constexpr int64_t kRacyCtime = INT64_MIN;

int64_t ns(const struct timespec& t) { return int64_t{t.tv_sec} * 1'000'000'000 + t.tv_nsec; }

Status scan(const std::string& host, const std::string& rel, uint64_t max_entries, UpperIndex& out) {
  DIR* d = ::opendir(host.c_str());
  if (d == nullptr) return fail_errno("opendir " + host, errno);
  std::vector<std::pair<std::string, std::string>> dirs;  // (host path, relative path), walked after readdir
  Status status;
  while (dirent* e = ::readdir(d)) {
    std::string_view name = e->d_name;
    if (name == "." || name == "..") continue;
    std::string child_host = host + "/" + std::string(name);
    std::string child_rel = rel.empty() ? std::string(name) : rel + "/" + std::string(name);
    struct stat st{};
    if (::lstat(child_host.c_str(), &st) != 0) {
      status = fail_errno("lstat " + child_host, errno);
      break;
    }
    if (out.size() >= max_entries) {
      status = fail(Error::kLimitExceeded, "the upper dir has more than " + std::to_string(max_entries) +
                                               " entries (the layer entry limit)");
      break;
    }
    EntrySig sig{static_cast<uint64_t>(st.st_ino), ns(st.st_ctim), ns(st.st_mtim), static_cast<uint64_t>(st.st_size),
                 st.st_mode, st.st_uid, st.st_gid, static_cast<uint64_t>(st.st_rdev), false};
    if (S_ISDIR(st.st_mode)) {
      sig.opaque = is_opaque_dir(child_host);
      dirs.emplace_back(child_host, child_rel);
    }
    out.emplace(child_rel, sig);
  }
  ::closedir(d);
  if (!status) return status;
  for (const auto& [child_host, child_rel] : dirs)
    if (auto s = scan(child_host, child_rel, max_entries, out); !s) return s;
  return {};
}

std::string parent_of(const std::string& path) {
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash);
}

}  // namespace

Result<UpperIndex> scan_upper(const std::string& upper, uint64_t max_entries) {
  UpperIndex out;
  if (auto s = scan(upper, "", max_entries, out); !s) return s.failure();
  return out;
}

void mark_racy(UpperIndex& index, int64_t since_ns) {
  for (auto& [path, sig] : index)
    if (sig.ctime_ns >= since_ns || sig.mtime_ns >= since_ns) sig.ctime_ns = kRacyCtime;
}

int64_t racy_threshold_now() {
  struct timespec now{}, tick{};
  ::clock_gettime(CLOCK_REALTIME_COARSE, &now);
  ::clock_getres(CLOCK_REALTIME_COARSE, &tick);
  return ns(now) - ns(tick);
}

int64_t racy_threshold_after(const UpperIndex& index, int64_t max_wait_ns) {
  int64_t newest = INT64_MIN;
  for (const auto& [path, sig] : index) newest = std::max(newest, sig.ctime_ns);
  int64_t threshold = racy_threshold_now();
  const int64_t give_up = threshold + max_wait_ns;
  while (threshold <= newest && threshold < give_up) {
    struct timespec tick{};
    ::clock_getres(CLOCK_REALTIME_COARSE, &tick);
    struct timespec nap{0, std::min<long>(tick.tv_nsec > 0 ? tick.tv_nsec / 2 : 500'000, 2'000'000)};
    ::nanosleep(&nap, nullptr);
    threshold = racy_threshold_now();
  }
  return threshold;
}

DeltaPlan plan_delta(const UpperIndex& previous, const UpperIndex& current) {
  DeltaPlan plan;
  std::set<std::string> changed;
  for (const auto& [path, sig] : current) {
    auto prev = previous.find(path);
    if (prev == previous.end() || !(prev->second == sig)) changed.insert(path);
    // Deleted and made again (or a directory over what was a file): its marker hides the layers below, so
    // everything under it goes in too, changed or not.
    bool newly_opaque = S_ISDIR(sig.mode) && sig.opaque &&
                        (prev == previous.end() || !prev->second.opaque || !S_ISDIR(prev->second.mode));
    if (!newly_opaque) continue;
    plan.opaque.insert(path);
    for (auto it = current.lower_bound(path + "/"); it != current.end() && it->first.starts_with(path + "/"); ++it)
      changed.insert(it->first);
  }
  for (const std::string& path : changed) {
    // The directories above an entry go in with it (a tar entry's parents must exist when it is unpacked).
    for (std::string p = path; !p.empty() && plan.entries.insert(p).second; p = parent_of(p)) {
    }
  }
  auto under_new_opaque = [&](std::string p) {
    for (; !p.empty(); p = parent_of(p))
      if (plan.opaque.count(p) != 0) return true;
    return false;
  };
  for (const auto& [path, sig] : previous) {
    if (current.count(path) != 0) continue;
    // Only the topmost path that is gone: below a gone directory, a whiteout, a file or a new opaque dir
    // nothing of the older layers shows anyway.
    std::string parent = parent_of(path);
    if (!parent.empty()) {
      auto p = current.find(parent);
      if (p == current.end() || !S_ISDIR(p->second.mode) || under_new_opaque(parent)) continue;
      plan.entries.insert(parent);
      for (std::string a = parent_of(parent); !a.empty() && plan.entries.insert(a).second; a = parent_of(a)) {
      }
    }
    plan.whiteouts.push_back(path);
  }
  return plan;
}

std::string encode_index(const CheckpointIndex& index) {
  std::string out(kMagic);
  out += "chain " + std::to_string(index.chain.size()) + "\n";
  for (const std::string& d : index.chain) out += d + "\n";
  out += "entries " + std::to_string(index.index.size()) + "\n";
  for (const auto& [path, s] : index.index) {
    out += std::to_string(s.ino) + " " + std::to_string(s.ctime_ns) + " " + std::to_string(s.mtime_ns) + " " +
           std::to_string(s.size) + " " + std::to_string(s.mode) + " " + std::to_string(s.uid) + " " +
           std::to_string(s.gid) + " " + std::to_string(s.rdev) + " " + (s.opaque ? "1" : "0") + " ";
    out += path;  // a path holds any byte but NUL, which ends it
    out += '\0';
  }
  // Last, so an index written before it (no base: its chain starts with the base) still reads.
  if (!index.base.empty()) {
    out += "base " + std::to_string(index.base.size()) + "\n";
    for (const std::string& d : index.base) out += d + "\n";
  }
  return out;
}

Result<CheckpointIndex> decode_index(std::string_view text) {
  auto bad = [](std::string_view what) {
    return fail(Error::kInvalidArgument, "checkpoint index: " + std::string(what));
  };
  if (!text.starts_with(kMagic)) return bad("no header");
  text.remove_prefix(kMagic.size());
  auto line = [&](std::string_view& out) {
    size_t nl = text.find('\n');
    if (nl == std::string_view::npos) return false;
    out = text.substr(0, nl);
    text.remove_prefix(nl + 1);
    return true;
  };
  auto count = [&](std::string_view prefix, uint64_t& n) {
    std::string_view l;
    if (!line(l) || !l.starts_with(prefix)) return false;
    l.remove_prefix(prefix.size());
    auto [end, ec] = std::from_chars(l.data(), l.data() + l.size(), n);
    return ec == std::errc() && end == l.data() + l.size();
  };
  CheckpointIndex out;
  uint64_t n = 0;
  if (!count("chain ", n) || n > 4096) return bad("bad chain count");
  for (uint64_t i = 0; i < n; ++i) {
    std::string_view d;
    if (!line(d) || !valid_digest(d)) return bad("bad chain digest");
    out.chain.emplace_back(d);
  }
  if (!count("entries ", n)) return bad("bad entry count");
  for (uint64_t i = 0; i < n; ++i) {
    size_t end = text.find('\0');
    if (end == std::string_view::npos) return bad("truncated entry");
    std::string_view rec = text.substr(0, end);
    text.remove_prefix(end + 1);
    EntrySig s;
    uint64_t opaque = 0;
    const char* p = rec.data();
    const char* stop = rec.data() + rec.size();
    auto field = [&](auto& v) {
      auto [next, ec] = std::from_chars(p, stop, v);
      if (ec != std::errc() || next == stop || *next != ' ') return false;
      p = next + 1;
      return true;
    };
    if (!field(s.ino) || !field(s.ctime_ns) || !field(s.mtime_ns) || !field(s.size) || !field(s.mode) ||
        !field(s.uid) || !field(s.gid) || !field(s.rdev) || !field(opaque) || opaque > 1 || p == stop)
      return bad("bad entry");
    s.opaque = opaque == 1;
    out.index.emplace(std::string(p, stop), s);
  }
  if (text.starts_with("base ")) {
    if (!count("base ", n) || n > 4096) return bad("bad base count");
    for (uint64_t i = 0; i < n; ++i) {
      std::string_view d;
      if (!line(d) || !valid_digest(d)) return bad("bad base digest");
      out.base.emplace_back(d);
    }
  }
  if (!text.empty()) return bad("trailing bytes");
  return out;
}

}  // namespace sg::snapshot
