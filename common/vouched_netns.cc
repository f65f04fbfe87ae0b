#include "common/vouched_netns.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <linux/nsfs.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statfs.h>

#include <cerrno>

namespace sg {

std::string vouched_netns_dir(const Endpoint& node_socket) {
  if (node_socket.kind != Endpoint::Kind::kUnix || node_socket.path.empty()) return {};
  return node_socket.path + ".netns";
}

Result<std::string> netns_mark_name(int netns_fd) {
  struct statfs fs{};
  if (::fstatfs(netns_fd, &fs) != 0) return fail_errno("fstatfs", errno);
  if (fs.f_type != NSFS_MAGIC) return fail(Error::kInvalidArgument, "not a namespace");
  if (::ioctl(netns_fd, NS_GET_NSTYPE) != CLONE_NEWNET) return fail(Error::kInvalidArgument, "not a network namespace");
  struct stat st{};
  if (::fstat(netns_fd, &st) != 0) return fail_errno("fstat", errno);
  return std::to_string(st.st_dev) + "-" + std::to_string(st.st_ino);
}

Status check_vouched(const std::string& dir, int netns_fd) {
  auto name = netns_mark_name(netns_fd);
  if (!name) return name.failure();
  struct stat d{};
  if (dir.empty() || ::lstat(dir.c_str(), &d) != 0 || !S_ISDIR(d.st_mode) || d.st_uid != 0 || (d.st_mode & 022) != 0)
    return fail(Error::kPermissionDenied, "no directory of vouched namespaces only root writes: " + dir);
  struct stat mark{};
  const std::string path = dir + "/" + *name;
  if (::lstat(path.c_str(), &mark) != 0 || !S_ISREG(mark.st_mode) || mark.st_uid != 0)
    return fail(Error::kPermissionDenied, "sandgate-node does not vouch for network namespace " + *name);
  return {};
}

}  // namespace sg
