#include "common/accounts.h"

#include <grp.h>
#include <pwd.h>

#include <cerrno>
#include <vector>

namespace sg {
namespace {

// One getpwnam_r / getgrnam_r call with a buffer that grows on ERANGE (a group with many members does not
// fit the first one); `take` copies what the caller needs out of the entry before the buffer goes.
template <typename Entry, typename T, typename Take>
Result<std::optional<T>> lookup(const std::string& name, int (*get)(const char*, Entry*, char*, size_t, Entry**),
                                Take take) {
  std::vector<char> buf(4096);
  Entry entry{};
  Entry* found = nullptr;
  int rc;
  while ((rc = get(name.c_str(), &entry, buf.data(), buf.size(), &found)) == ERANGE && buf.size() < (1u << 22))
    buf.resize(buf.size() * 2);
  if (rc != 0) return fail_errno("cannot look up " + name, rc);
  if (!found) return std::optional<T>();
  return std::optional<T>(take(entry));
}

}  // namespace

Result<std::optional<UserAccount>> find_user(const std::string& name) {
  return lookup<passwd, UserAccount>(name, ::getpwnam_r, [](const passwd& pw) {
    return UserAccount{pw.pw_name, pw.pw_uid, pw.pw_gid};
  });
}

Result<std::optional<gid_t>> find_group(const std::string& name) {
  return lookup<group, gid_t>(name, ::getgrnam_r, [](const group& gr) { return gr.gr_gid; });
}

}  // namespace sg
