#include "noderuntime/netns_vouchers.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/fd.h"
#include "common/log.h"
#include "common/vouched_netns.h"

namespace sg {

Status NetnsVouchers::reset() {
  marks_.clear();
  if (dir_.empty()) return {};
  if (::mkdir(dir_.c_str(), 0755) != 0 && errno != EEXIST) return fail_errno("mkdir " + dir_, errno);
  // Emptied through a descriptor of the directory itself, one level only: a link put in its place, or
  // inside it, is not followed by root.
  UniqueFd dir(::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!dir.valid()) return fail_errno("open " + dir_ + " (it must be a directory)", errno);
  struct stat st{};
  if (::fstat(dir.get(), &st) != 0 || st.st_uid != 0) return fail(Error::kPermissionDenied, dir_ + " is not root's");
  // fdopendir owns the descriptor it is given: a duplicate, so `dir` stays usable for unlinkat.
  DIR* listing = ::fdopendir(::fcntl(dir.get(), F_DUPFD_CLOEXEC, 0));
  if (listing == nullptr) return fail_errno("list " + dir_, errno);
  while (const dirent* entry = ::readdir(listing)) {
    const std::string name = entry->d_name;
    if (name == "." || name == "..") continue;
    if (::unlinkat(dir.get(), name.c_str(), 0) != 0 && errno != ENOENT)
      spdlog::warn("cannot remove {}/{}: {}", dir_, name, std::strerror(errno));
  }
  ::closedir(listing);
  // mkdir's mode passes through the umask, and an existing directory keeps its own: the maker refuses one
  // others may write.
  if (::fchmod(dir.get(), 0755) != 0) return fail_errno("chmod " + dir_, errno);
  return check_marks_dir(dir_);
}

Status NetnsVouchers::vouch(const std::string& sandbox_id, int sock) {
  if (dir_.empty()) return {};
  auto cookie = netns_cookie(sock);
  if (!cookie) return cookie.failure();
  const std::string name = netns_mark_name(*cookie);
  auto it = marks_.find(sandbox_id);
  if (it != marks_.end() && it->second == name) return {};
  if (it != marks_.end()) revoke(sandbox_id);
  const std::string path = dir_ + "/" + name;
  UniqueFd mark(::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0444));
  if (!mark.valid() && errno == ENOENT) {  // a node that never reconciled (a test's), or a directory removed
    if (Status made = reset(); !made) return made;
    mark.reset(::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0444));
  }
  if (!mark.valid()) return fail_errno("create " + path, errno);
  marks_[sandbox_id] = name;
  return {};
}

void NetnsVouchers::revoke(const std::string& sandbox_id) {
  auto it = marks_.find(sandbox_id);
  if (it == marks_.end()) return;
  const std::string path = dir_ + "/" + it->second;
  marks_.erase(it);
  // A mark that cannot be removed lets the maker enter a namespace the node no longer vouches for (while
  // that namespace lives); one already gone means someone changed the directory: both said loudly.
  if (::unlink(path.c_str()) != 0)
    spdlog::error("cannot remove {} ({}): the proxy's socket maker may still enter that namespace", path,
                  errno == ENOENT ? "it is gone: was the directory replaced?" : std::strerror(errno));
}

}  // namespace sg
