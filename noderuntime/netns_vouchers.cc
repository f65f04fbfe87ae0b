#include "noderuntime/netns_vouchers.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "common/fd.h"
#include "common/log.h"
#include "common/vouched_netns.h"

namespace sg {

Status NetnsVouchers::reset() {
  marks_.clear();
  if (dir_.empty()) return {};
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
  if (ec) return fail(Error::kIo, "cannot empty " + dir_ + ": " + ec.message());
  if (::mkdir(dir_.c_str(), 0755) != 0) return fail_errno("mkdir " + dir_, errno);
  // mkdir's mode passes through the umask; the maker refuses a directory others may write.
  if (::chmod(dir_.c_str(), 0755) != 0) return fail_errno("chmod " + dir_, errno);
  return {};
}

Status NetnsVouchers::vouch(const std::string& sandbox_id, int netns_fd) {
  if (dir_.empty()) return {};
  auto name = netns_mark_name(netns_fd);
  if (!name) return name.failure();
  auto it = marks_.find(sandbox_id);
  if (it != marks_.end() && it->second == *name) return {};
  if (it != marks_.end()) revoke(sandbox_id);
  const std::string path = dir_ + "/" + *name;
  UniqueFd mark(::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0444));
  if (!mark.valid() && errno == ENOENT) {  // a node that never reconciled (a test's), or a directory removed
    if (Status made = reset(); !made) return made;
    mark.reset(::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0444));
  }
  if (!mark.valid()) return fail_errno("create " + path, errno);
  marks_[sandbox_id] = *name;
  return {};
}

void NetnsVouchers::revoke(const std::string& sandbox_id) {
  auto it = marks_.find(sandbox_id);
  if (it == marks_.end()) return;
  const std::string path = dir_ + "/" + it->second;
  marks_.erase(it);
  // A mark left behind lets the maker enter a namespace the node no longer vouches for: say so loudly.
  if (::unlink(path.c_str()) != 0 && errno != ENOENT)
    spdlog::error("cannot remove {} (the proxy's socket maker may still enter that namespace): {}", path,
                  std::strerror(errno));
}

}  // namespace sg
