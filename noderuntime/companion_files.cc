#include "noderuntime/companion_files.h"

#include <limits.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

namespace sg {
namespace {

CompanionLookup first_executable(const std::string& configured, const std::vector<std::string>& relative) {
  CompanionLookup l;
  if (!configured.empty()) {
    l.tried.push_back(configured);
  } else if (auto dir = exe_dir()) {
    for (const std::string& r : relative) l.tried.push_back(*dir + r);
  }
  for (const std::string& path : l.tried) {
    if (::access(path.c_str(), X_OK) == 0) {
      std::error_code ec;
      auto clean = std::filesystem::weakly_canonical(path, ec);  // for the logs: no "bin/../agent"
      l.path = ec ? path : clean.string();
      break;
    }
  }
  return l;
}

}  // namespace

Result<std::string> exe_dir() {
  char exe[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n < 0) return fail_errno("readlink /proc/self/exe", errno);
  std::string path(exe, static_cast<size_t>(n));
  path.erase(path.rfind('/') + 1);
  return path;
}

std::string CompanionLookup::tried_text() const {
  if (tried.empty()) return "nothing: cannot find this executable";
  std::string s;
  for (const std::string& t : tried) s += (s.empty() ? "" : ", ") + t;
  return s;
}

CompanionLookup find_agent_binary(const std::string& configured) {
  return first_executable(configured, {"sandgate-agent", "../agent/sandgate-agent"});
}

CompanionLookup find_guest_image_builder(const std::string& configured) {
  return first_executable(configured,
                          {"../share/sandgate/build-guest-image.sh", "../../deploy/build-guest-image.sh"});
}

}  // namespace sg
