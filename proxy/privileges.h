// Least privilege for sandgate-proxy: a proxy started as root (to bind port 443 and read root-only keys)
// switches to proxy.user once it has everything only root can get, and keeps no way back.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "common/error.h"

namespace sg {

struct DroppedPrivileges {
  std::string user;
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary groups
  bool switched = false;      // false: the process already ran as that user and group
};

// `user` and `group` ("" = the user's primary group) as ids, refused as drop_privileges refuses them (root's
// uid or gid, unknown names); `switched` false, `groups` empty.
Result<DroppedPrivileges> resolve_proxy_user(const std::string& user, const std::string& group);

// Makes the process run as `user` (and `group`, "" = the user's primary group) for good:
// setgroups (the user's supplementary groups from the group database, plus `group`), setgid, setuid, each
// checked, then verifies that real, effective and saved ids are the new ones, that setuid(0) and setgid(0)
// fail, and that no capability is left (capget: effective, permitted and inheritable all empty); sets
// PR_SET_NO_NEW_PRIVS too. Glibc applies set*id to every thread of the process (nptl's setxid signal), but
// the proxy calls this before its workers start, so there is only one thread to switch.
// Not root: succeeds (switched = false) if the process already runs as that user (and group, if given);
// otherwise kPermissionDenied naming proxy.user, since an unprivileged process cannot switch.
Result<DroppedPrivileges> drop_privileges(const std::string& user, const std::string& group);

// "uid 65534 (nobody), gid 65534, groups 65534": for the log line.
std::string describe(const DroppedPrivileges& d);

}  // namespace sg
