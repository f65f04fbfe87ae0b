#include "common/vouched_netns.h"

#include <sys/socket.h>
#include <sys/stat.h>

#include <cerrno>
#include <filesystem>

namespace sg {

std::string vouched_netns_dir(const Endpoint& node_socket) {
  if (node_socket.kind != Endpoint::Kind::kUnix || node_socket.path.empty()) return {};
  return node_socket.path + ".netns";
}

Result<uint64_t> netns_cookie(int sock) {
  uint64_t cookie = 0;
  socklen_t len = sizeof cookie;
  if (::getsockopt(sock, SOL_SOCKET, SO_NETNS_COOKIE, &cookie, &len) != 0 || len != sizeof cookie)
    return fail_errno("getsockopt(SO_NETNS_COOKIE)", errno);
  return cookie;
}

std::string netns_mark_name(uint64_t cookie) { return "netns-" + std::to_string(cookie); }

namespace {

// `dir` and each directory above it, as written: root's and writable by nobody else (or sticky, as /tmp
// is); a symbolic link on the way (/var/run) must be root's, and the directory it lives in is checked next.
Status check_chain(const std::filesystem::path& dir, const std::string& shown) {
  std::filesystem::path at = dir;
  for (bool first = true;; first = false) {
    struct stat st{};
    const bool ok = ::lstat(at.c_str(), &st) == 0 && st.st_uid == 0 &&
                    (S_ISDIR(st.st_mode) ? (st.st_mode & 022) == 0 || (!first && (st.st_mode & S_ISVTX) != 0)
                                         : S_ISLNK(st.st_mode) && !first);
    if (!ok)
      return fail(Error::kPermissionDenied, "the vouched namespaces' directory " + shown + " is not root's alone (" +
                                                at.string() + ")");
    if (at == at.root_path()) return {};
    at = at.parent_path();
  }
}

}  // namespace

Status check_marks_dir(const std::string& dir) {
  if (dir.empty() || dir.front() != '/') return fail(Error::kPermissionDenied, "no directory of vouched namespaces");
  if (Status lexical = check_chain(std::filesystem::path(dir).lexically_normal(), dir); !lexical) return lexical;
  std::error_code ec;
  const std::filesystem::path real = std::filesystem::canonical(dir, ec);
  if (ec) return fail(Error::kPermissionDenied, "the vouched namespaces' directory " + dir + ": " + ec.message());
  return check_chain(real, dir);  // where the links on the way lead
}

Status check_vouched(const std::string& dir, int sock) {
  if (Status safe = check_marks_dir(dir); !safe) return safe;
  auto cookie = netns_cookie(sock);
  if (!cookie) return fail(Error::kPermissionDenied, cookie.message());
  struct stat mark{};
  const std::string path = dir + "/" + netns_mark_name(*cookie);
  if (::lstat(path.c_str(), &mark) != 0 || !S_ISREG(mark.st_mode) || mark.st_uid != 0)
    return fail(Error::kPermissionDenied, "sandgate-node does not vouch for network namespace " + std::to_string(*cookie));
  return {};
}

}  // namespace sg
