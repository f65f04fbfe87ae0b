#include "proxy/privileges.h"

#include <grp.h>
#include <linux/capability.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "common/accounts.h"

namespace sg {
namespace {

// The user's groups from the group database with `gid` among them (getgrouplist adds it), so that access an
// operator grants through group membership (ssl-cert for /etc/ssl/private keys, say) keeps working.
Result<std::vector<gid_t>> supplementary_groups(const std::string& user, gid_t gid) {
  std::vector<gid_t> groups(32);
  for (int attempt = 0; attempt < 8; ++attempt) {
    int n = static_cast<int>(groups.size());
    if (::getgrouplist(user.c_str(), gid, groups.data(), &n) >= 0) {
      groups.resize(static_cast<size_t>(n));
      return groups;
    }
    // Too small: n now holds the number needed.
    groups.resize(static_cast<size_t>(n) > groups.size() ? static_cast<size_t>(n) : groups.size() * 2);
  }
  return fail(Error::kInternal, "getgrouplist(" + user + "): the group list keeps growing");
}

// No capability may survive: after setuid from root to another user without PR_SET_KEEPCAPS the kernel
// clears the permitted and effective sets (and with them the ambient set, which is a subset of permitted).
Status check_no_capabilities() {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {};
  if (::syscall(SYS_capget, &header, data) != 0) return fail_errno("capget", errno);
  for (const auto& d : data)
    if (d.effective != 0 || d.permitted != 0 || d.inheritable != 0)
      return fail(Error::kInternal, "capabilities are left after the switch to an unprivileged user");
  return {};
}

}  // namespace

Result<DroppedPrivileges> resolve_proxy_user(const std::string& user, const std::string& group) {
  auto account = find_user(user);
  if (!account) return fail(account.error(), "proxy.user: " + account.message());
  if (!*account) return fail(Error::kNotFound, "proxy.user: no user named \"" + user + "\"");
  DroppedPrivileges d;
  d.user = user;
  d.uid = (*account)->uid;
  d.gid = (*account)->gid;
  if (!group.empty()) {
    auto gid = find_group(group);
    if (!gid) return fail(gid.error(), "proxy.group: " + gid.message());
    if (!*gid) return fail(Error::kNotFound, "proxy.group: no group named \"" + group + "\"");
    d.gid = **gid;
  }
  if (d.uid == 0) return fail(Error::kInvalidArgument, "proxy.user: \"" + user + "\" is root (uid 0)");
  if (d.gid == 0)
    return fail(Error::kInvalidArgument, group.empty() ? "proxy.user: the primary group of \"" + user +
                                                             "\" is root's (gid 0); set proxy.group"
                                                       : "proxy.group: \"" + group + "\" is root's group (gid 0)");
  return d;
}

Result<DroppedPrivileges> drop_privileges(const std::string& user, const std::string& group) {
  auto resolved = resolve_proxy_user(user, group);
  if (!resolved) return resolved.failure();
  DroppedPrivileges d = std::move(*resolved);

  if (::geteuid() != 0) {
    uid_t ruid, euid, suid;
    gid_t rgid, egid, sgid;
    ::getresuid(&ruid, &euid, &suid);
    ::getresgid(&rgid, &egid, &sgid);
    bool same_user = ruid == d.uid && euid == d.uid && suid == d.uid;
    bool same_group = group.empty() || (rgid == d.gid && egid == d.gid && sgid == d.gid);
    if (same_user && same_group) {
      d.groups.resize(static_cast<size_t>(std::max(::getgroups(0, nullptr), 0)));
      int n = ::getgroups(static_cast<int>(d.groups.size()), d.groups.data());
      d.groups.resize(static_cast<size_t>(std::max(n, 0)));
      d.gid = egid;
      return d;
    }
    return fail(Error::kPermissionDenied,
                "proxy.user = \"" + user + "\"" + (group.empty() ? "" : ", proxy.group = \"" + group + "\"") +
                    ": sandgate-proxy runs as uid " + std::to_string(euid) + " gid " + std::to_string(egid) +
                    ", not as root, so it cannot switch to uid " + std::to_string(d.uid) + " gid " +
                    std::to_string(d.gid) + "; start it as root or as that user, or leave proxy.user empty");
  }

  auto groups = supplementary_groups(user, d.gid);
  if (!groups) return groups.failure();
  d.groups = std::move(*groups);
  // Groups first, then the gid, then the uid: each of the first two needs root, which the last one ends.
  if (::setgroups(d.groups.size(), d.groups.data()) != 0) return fail_errno("setgroups", errno);
  if (::setgid(d.gid) != 0) return fail_errno("setgid(" + std::to_string(d.gid) + ")", errno);
  if (::setuid(d.uid) != 0) return fail_errno("setuid(" + std::to_string(d.uid) + ")", errno);
  d.switched = true;

  // Trust, but verify: a set*id that half worked (a saved id left at 0) could be undone by whoever takes
  // over the process.
  uid_t ruid, euid, suid;
  gid_t rgid, egid, sgid;
  if (::getresuid(&ruid, &euid, &suid) != 0) return fail_errno("getresuid", errno);
  if (::getresgid(&rgid, &egid, &sgid) != 0) return fail_errno("getresgid", errno);
  if (ruid != d.uid || euid != d.uid || suid != d.uid || rgid != d.gid || egid != d.gid || sgid != d.gid)
    return fail(Error::kInternal, "after setuid/setgid the process does not run as " + describe(d));
  if (::setuid(0) == 0 || ::setgid(0) == 0)
    return fail(Error::kInternal, "the process could regain root after switching to " + describe(d));
  if (auto s = check_no_capabilities(); !s) return s.failure();
  // The proxy never executes anything; this makes sure nothing it might run could gain privileges either.
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return fail_errno("prctl(PR_SET_NO_NEW_PRIVS)", errno);
  return d;
}

std::string describe(const DroppedPrivileges& d) {
  std::string groups;
  for (gid_t g : d.groups) groups += (groups.empty() ? "" : ",") + std::to_string(g);
  return "uid " + std::to_string(d.uid) + " (" + d.user + "), gid " + std::to_string(d.gid) + ", groups " +
         (groups.empty() ? "none" : groups);
}

}  // namespace sg
