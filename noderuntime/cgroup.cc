#include "noderuntime/cgroup.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include "common/fd.h"

namespace sg {
namespace {

// CFS bandwidth period; the quota is expressed as a fraction of it (cpus * period).
constexpr long kCpuPeriodUs = 100'000;
// The kernel rejects quotas below 1 ms.
constexpr long kMinCpuQuotaUs = 1'000;
constexpr auto kRemoveRetryFor = std::chrono::seconds(1);

Failure fail_path(std::string_view op, const std::string& path, int err) {
  Error code = Error::kIo;
  if (err == ENOENT) code = Error::kNotFound;
  if (err == EACCES || err == EPERM || err == EROFS) code = Error::kPermissionDenied;
  std::string msg = "cgroup: ";
  msg += op;
  msg += " ";
  msg += path;
  msg += ": ";
  msg += std::strerror(err);
  return fail(code, std::move(msg));
}

Result<std::string> read_file(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return fail_path("open", path, errno);
  std::string content;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail_path("read", path, errno);
    if (n == 0) return content;
    content.append(buf, static_cast<size_t>(n));
  }
}

// cgroup files take one value per write(2); the kernel validates it and reports rejection through errno.
Status write_file(const std::string& path, std::string_view value) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
  if (!fd.valid()) return fail_path("open", path, errno);
  ssize_t n;
  do {
    n = ::write(fd.get(), value.data(), value.size());
  } while (n < 0 && errno == EINTR);
  if (n < 0) return fail_path("write \"" + std::string(value) + "\" to", path, errno);
  return {};
}

Status make_dir(const std::string& path) {
  if (::mkdir(path.c_str(), 0755) == 0 || errno == EEXIST) return {};
  return fail_path("mkdir", path, errno);
}

std::vector<std::string_view> split(std::string_view text, char sep) {
  std::vector<std::string_view> parts;
  while (!text.empty()) {
    size_t end = text.find(sep);
    std::string_view part = text.substr(0, end);
    if (!part.empty()) parts.push_back(part);
    if (end == std::string_view::npos) break;
    text.remove_prefix(end + 1);
  }
  return parts;
}

std::vector<std::string> split_words(std::string_view text) {
  std::vector<std::string> words;
  size_t i = 0;
  while (i < text.size()) {
    while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
    size_t start = i;
    while (i < text.size() && !std::isspace(static_cast<unsigned char>(text[i]))) ++i;
    if (i > start) words.emplace_back(text.substr(start, i - start));
  }
  return words;
}

// mountinfo escapes space, tab, newline and backslash in paths as \ooo octal.
std::string unescape_mount_path(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size()) {
      int value = 0;
      bool octal = true;
      for (size_t j = 1; j <= 3; ++j) {
        char c = s[i + j];
        if (c < '0' || c > '7') octal = false;
        value = value * 8 + (c - '0');
      }
      if (octal) {
        out += static_cast<char>(value);
        i += 3;
        continue;
      }
    }
    out += s[i];
  }
  return out;
}

bool contains(const std::vector<std::string>& list, std::string_view item) {
  return std::find(list.begin(), list.end(), item) != list.end();
}

std::string join_path(const std::string& a, std::string_view b) {
  if (a.empty() || a.back() == '/') return a + std::string(b);
  return a + "/" + std::string(b);
}

}  // namespace

std::string_view cgroup_version_name(CgroupVersion v) {
  switch (v) {
    case CgroupVersion::kNone: return "none";
    case CgroupVersion::kV1: return "v1";
    case CgroupVersion::kV2: return "v2";
  }
  return "unknown";
}

std::string CgroupDetection::describe() const {
  auto line = [](std::string_view feature, const CgroupFeature& f, std::string_view fallback) {
    std::string s(feature);
    s += ": ";
    if (f.version == CgroupVersion::kNone) return s + std::string(fallback) + "\n";
    return s + std::string(cgroup_version_name(f.version)) + " " + f.mount + "\n";
  };
  std::string out = "cgroup2 mount: " + (mounts.v2_mount.empty() ? std::string("none") : mounts.v2_mount);
  if (!mounts.v2_mount.empty()) {
    out += " (controllers:";
    for (const auto& c : v2_controllers) out += " " + c;
    out += ")";
  }
  out += "\ncgroup v1 controllers:";
  if (mounts.v1_mounts.empty()) out += " none";
  for (const auto& [controller, mount] : mounts.v1_mounts) out += " " + controller + "=" + mount;
  out += "\n";
  out += line("freeze", freeze, "none (pause unsupported)");
  out += line("memory limit", memory, "none (memory limits not enforced)");
  out += line("cpu limit", cpu, "none (cpu limits not enforced)");
  out += line("pids limit", pids, "none (process counts not limited)");
  out += "kill: ";
  out += mounts.v2_mount.empty() ? "SIGKILL each pid in cgroup.procs" : "cgroup.kill, else SIGKILL each pid";
  return out;
}

CgroupMounts parse_cgroup_mounts(std::string_view mountinfo) {
  CgroupMounts mounts;
  for (std::string_view line : split(mountinfo, '\n')) {
    // "<id> <parent> <maj:min> <root> <mount point> <options> [optional fields...] - <fstype> <source> <superopts>"
    std::vector<std::string_view> fields = split(line, ' ');
    auto separator = std::find(fields.begin(), fields.end(), "-");
    if (fields.size() < 5 || separator == fields.end() || fields.end() - separator < 4) continue;
    std::string_view fstype = separator[1];
    std::string mount_point = unescape_mount_path(fields[4]);
    if (fstype == "cgroup2") {
      if (mounts.v2_mount.empty()) mounts.v2_mount = mount_point;
    } else if (fstype == "cgroup") {
      // Super options list the controllers bound to this hierarchy next to generic flags and name=<x>.
      for (std::string_view opt : split(separator[3], ',')) {
        if (opt == "rw" || opt == "ro" || opt.find('=') != std::string_view::npos) continue;
        mounts.v1_mounts.emplace(std::string(opt), mount_point);  // the first mount of a controller wins
      }
    }
  }
  return mounts;
}

CgroupDetection choose_cgroup_features(CgroupMounts mounts, std::vector<std::string> v2_controllers) {
  CgroupDetection d;
  d.mounts = std::move(mounts);
  d.v2_controllers = std::move(v2_controllers);
  const bool has_v2 = !d.mounts.v2_mount.empty();
  auto pick = [&](bool v2_serves, const char* v1_controller) {
    if (v2_serves) return CgroupFeature{CgroupVersion::kV2, d.mounts.v2_mount};
    auto it = d.mounts.v1_mounts.find(v1_controller);
    if (it != d.mounts.v1_mounts.end()) return CgroupFeature{CgroupVersion::kV1, it->second};
    return CgroupFeature{};
  };
  d.freeze = pick(has_v2, "freezer");
  d.memory = pick(has_v2 && contains(d.v2_controllers, "memory"), "memory");
  d.cpu = pick(has_v2 && contains(d.v2_controllers, "cpu"), "cpu");
  d.pids = pick(has_v2 && contains(d.v2_controllers, "pids"), "pids");
  return d;
}

Result<CgroupDetection> detect_cgroups() {
  auto mountinfo = read_file("/proc/self/mountinfo");
  if (!mountinfo) return mountinfo.failure();
  CgroupMounts mounts = parse_cgroup_mounts(*mountinfo);
  std::vector<std::string> controllers;
  if (!mounts.v2_mount.empty()) {
    auto text = read_file(join_path(mounts.v2_mount, "cgroup.controllers"));
    if (!text) return text.failure();
    controllers = split_words(*text);
  }
  return choose_cgroup_features(std::move(mounts), std::move(controllers));
}

Status SandboxCgroup::add_pid(int pid) const {
  const std::string value = std::to_string(pid);
  for (const auto& dir : dirs_) {
    if (Status s = write_file(join_path(dir, "cgroup.procs"), value); !s) return s;
  }
  return {};
}

Status SandboxCgroup::freeze() const {
  switch (freezer_.version) {
    case CgroupVersion::kV2: return write_file(join_path(freezer_.dir, "cgroup.freeze"), "1");
    case CgroupVersion::kV1: return write_file(join_path(freezer_.dir, "freezer.state"), "FROZEN");
    case CgroupVersion::kNone: break;
  }
  return fail(Error::kUnsupported, "cgroup: no freezer on this host (neither cgroup2 nor the v1 freezer is mounted)");
}

Status SandboxCgroup::thaw() const {
  switch (freezer_.version) {
    case CgroupVersion::kV2: return write_file(join_path(freezer_.dir, "cgroup.freeze"), "0");
    case CgroupVersion::kV1: return write_file(join_path(freezer_.dir, "freezer.state"), "THAWED");
    case CgroupVersion::kNone: break;
  }
  return fail(Error::kUnsupported, "cgroup: no freezer on this host (neither cgroup2 nor the v1 freezer is mounted)");
}

Result<bool> SandboxCgroup::is_frozen() const {
  if (freezer_.version == CgroupVersion::kNone) return false;
  const std::string path = freezer_state_file();
  auto text = read_file(path);
  if (!text) return text.failure();
  std::vector<std::string> words = split_words(*text);
  if (freezer_.version == CgroupVersion::kV1) return !words.empty() && words[0] == "FROZEN";
  for (size_t i = 0; i + 1 < words.size(); i += 2) {
    if (words[i] == "frozen") return words[i + 1] == "1";
  }
  return fail(Error::kUnsupported, "cgroup: " + path + " has no \"frozen\" key (kernel older than 5.2?)");
}

Status SandboxCgroup::kill_all() const {
  if (!v2_dir_.empty()) {
    const std::string kill_file = join_path(v2_dir_, "cgroup.kill");
    if (::access(kill_file.c_str(), F_OK) == 0) {
      Status s = write_file(kill_file, "1");
      if (!s && s.error() != Error::kNotFound) return s;  // kNotFound: the group vanished meanwhile
      return {};
    }
  }
  // No cgroup.kill (kernel < 5.14 or no cgroup2): signal every listed task. A task forked after the listing
  // escapes this pass, but it also lives in the sandbox's PID namespace, which dies with its init.
  for (const auto& dir : dirs_) {
    auto procs = read_file(join_path(dir, "cgroup.procs"));
    if (!procs) {
      if (procs.error() == Error::kNotFound) continue;
      return procs.failure();
    }
    for (const auto& word : split_words(*procs)) {
      int pid = 0;
      auto [ptr, ec] = std::from_chars(word.data(), word.data() + word.size(), pid);
      if (ec != std::errc() || ptr != word.data() + word.size() || pid <= 0) continue;
      if (::kill(pid, SIGKILL) != 0 && errno != ESRCH) return fail_errno("kill " + word, errno);
    }
  }
  if (can_freeze()) {
    Status s = thaw();
    if (!s && s.error() != Error::kNotFound) return s;
  }
  return {};
}

Status SandboxCgroup::remove() const {
  const auto deadline = std::chrono::steady_clock::now() + kRemoveRetryFor;
  for (const auto& dir : dirs_) {
    auto pause = std::chrono::milliseconds(1);
    while (::rmdir(dir.c_str()) != 0) {
      if (errno == ENOENT) break;
      if (errno != EBUSY || std::chrono::steady_clock::now() >= deadline) return fail_path("rmdir", dir, errno);
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(50));
    }
  }
  return {};
}

std::string SandboxCgroup::freezer_state_file() const {
  switch (freezer_.version) {
    case CgroupVersion::kV2: return join_path(freezer_.dir, "cgroup.events");
    case CgroupVersion::kV1: return join_path(freezer_.dir, "freezer.state");
    case CgroupVersion::kNone: break;
  }
  return {};
}

std::string SandboxCgroup::memory_limit_file() const {
  switch (memory_.version) {
    case CgroupVersion::kV2: return join_path(memory_.dir, "memory.max");
    case CgroupVersion::kV1: return join_path(memory_.dir, "memory.limit_in_bytes");
    case CgroupVersion::kNone: break;
  }
  return {};
}

std::string SandboxCgroup::pids_max_file() const {
  return pids_.version == CgroupVersion::kNone ? std::string() : join_path(pids_.dir, "pids.max");
}

std::string SandboxCgroup::cpu_quota_file() const {
  switch (cpu_.version) {
    case CgroupVersion::kV2: return join_path(cpu_.dir, "cpu.max");
    case CgroupVersion::kV1: return join_path(cpu_.dir, "cpu.cfs_quota_us");
    case CgroupVersion::kNone: break;
  }
  return {};
}

CgroupManager::CgroupManager(CgroupDetection detection, std::string parent_name)
    : detection_(std::move(detection)), parent_name_(std::move(parent_name)) {}

std::vector<std::string> CgroupManager::mounts_in_use() const {
  std::vector<std::string> mounts;
  for (const CgroupFeature* f : {&detection_.freeze, &detection_.memory, &detection_.cpu, &detection_.pids}) {
    if (f->version != CgroupVersion::kNone && !contains(mounts, f->mount)) mounts.push_back(f->mount);
  }
  return mounts;
}

std::vector<std::string> CgroupManager::parent_dirs() const {
  std::vector<std::string> dirs;
  for (const auto& mount : mounts_in_use()) dirs.push_back(join_path(mount, parent_name_));
  return dirs;
}

SandboxCgroup CgroupManager::sandbox(const std::string& id) const {
  SandboxCgroup cg;
  auto place = [&](const CgroupFeature& f) {
    if (f.version == CgroupVersion::kNone) return SandboxCgroup::Placement{};
    return SandboxCgroup::Placement{f.version, join_path(join_path(f.mount, parent_name_), id)};
  };
  cg.freezer_ = place(detection_.freeze);
  cg.memory_ = place(detection_.memory);
  cg.cpu_ = place(detection_.cpu);
  cg.pids_ = place(detection_.pids);
  for (const auto* p : {&cg.freezer_, &cg.memory_, &cg.cpu_, &cg.pids_}) {
    if (p->version == CgroupVersion::kV2) cg.v2_dir_ = p->dir;
  }
  for (const auto& mount : mounts_in_use()) cg.dirs_.push_back(join_path(join_path(mount, parent_name_), id));
  return cg;
}

Status CgroupManager::prepare_parents(const std::string& mount) const {
  // A v2 controller only shows up in a child when every ancestor lists it in cgroup.subtree_control.
  std::string enable;
  if (mount == detection_.mounts.v2_mount) {
    if (detection_.memory.version == CgroupVersion::kV2) enable += "+memory ";
    if (detection_.cpu.version == CgroupVersion::kV2) enable += "+cpu ";
    if (detection_.pids.version == CgroupVersion::kV2) enable += "+pids ";
  }
  if (!enable.empty()) enable.pop_back();

  std::string dir = mount;
  for (std::string_view level : split(parent_name_, '/')) {
    if (!enable.empty()) {
      if (Status s = write_file(join_path(dir, "cgroup.subtree_control"), enable); !s) return s;
    }
    dir = join_path(dir, level);
    if (Status s = make_dir(dir); !s) return s;
  }
  if (!enable.empty()) return write_file(join_path(dir, "cgroup.subtree_control"), enable);
  return {};
}

Result<SandboxCgroup> CgroupManager::create(const std::string& id, double cpus, uint32_t memory_mb,
                                            uint32_t pids_max) const {
  if (id.empty() || id.find('/') != std::string::npos || id == "." || id == "..")
    return fail(Error::kInvalidArgument, "cgroup: invalid sandbox id \"" + id + "\"");
  SandboxCgroup cg = sandbox(id);
  auto undo = [&](Failure f) -> Result<SandboxCgroup> {
    (void)cg.remove();  // best effort: the original failure is the one worth reporting
    return f;
  };

  for (const auto& mount : mounts_in_use()) {
    if (Status s = prepare_parents(mount); !s) return undo(s.failure());
    if (Status s = make_dir(join_path(join_path(mount, parent_name_), id)); !s) return undo(s.failure());
  }

  if (memory_mb > 0 && cg.memory_.version != CgroupVersion::kNone) {
    const std::string bytes = std::to_string(static_cast<uint64_t>(memory_mb) * 1024 * 1024);
    if (Status s = write_file(cg.memory_limit_file(), bytes); !s) return undo(s.failure());
  }

  if (pids_max > 0 && cg.pids_.version != CgroupVersion::kNone) {
    if (Status s = write_file(cg.pids_max_file(), std::to_string(pids_max)); !s) return undo(s.failure());
  }

  if (cpus > 0 && cg.cpu_.version != CgroupVersion::kNone) {
    const long quota = std::max(kMinCpuQuotaUs, std::lround(cpus * static_cast<double>(kCpuPeriodUs)));
    if (cg.cpu_.version == CgroupVersion::kV2) {
      const std::string value = std::to_string(quota) + " " + std::to_string(kCpuPeriodUs);
      if (Status s = write_file(cg.cpu_quota_file(), value); !s) return undo(s.failure());
    } else {
      // The period first: the kernel validates the quota against the current period.
      Status s = write_file(join_path(cg.cpu_.dir, "cpu.cfs_period_us"), std::to_string(kCpuPeriodUs));
      if (!s) return undo(s.failure());
      if (s = write_file(cg.cpu_quota_file(), std::to_string(quota)); !s) return undo(s.failure());
    }
  }
  return cg;
}

}  // namespace sg
