// Users and groups by name, from the system databases (NSS: /etc/passwd, /etc/group, or a directory
// service). Used for the least-privilege keys: proxy.user / proxy.group (the proxy switches to them) and
// node.socket_group (the group of the node's API socket).
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>

#include "common/error.h"

namespace sg {

struct UserAccount {
  std::string name;
  uid_t uid = 0;
  gid_t gid = 0;  // primary group
};

// nullopt: no such name. A failed lookup (an unreachable directory service, say) is an error, so it is never
// mistaken for "no such user".
Result<std::optional<UserAccount>> find_user(const std::string& name);
Result<std::optional<gid_t>> find_group(const std::string& name);

}  // namespace sg
