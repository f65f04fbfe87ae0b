// drop_privileges, in a forked child each time: the switch is for good, so the test process itself must
// stay root for the tests that follow.
#include "proxy/privileges.h"

#include <grp.h>
#include <sys/types.h>
#include <gtest/gtest.h>
#include <pwd.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <sstream>
#include <vector>

namespace sg {
namespace {

struct Account {
  std::string user;
  std::string group;  // its primary group
  uid_t uid;
  gid_t gid;
};

// Unprivileged accounts of this machine (Debian has daemon, bin, nobody, ...): not root, primary group not
// root's.
std::vector<Account> unprivileged_accounts() {
  std::vector<Account> found;
  ::setpwent();
  while (passwd* pw = ::getpwent()) {
    group* gr = pw->pw_uid != 0 && pw->pw_gid != 0 ? ::getgrgid(pw->pw_gid) : nullptr;
    if (gr) found.push_back({pw->pw_name, gr->gr_name, pw->pw_uid, pw->pw_gid});
  }
  ::endpwent();
  return found;
}

// Runs `body` in a child process and returns what it wrote: "" means every check in it passed.
std::string in_child(const std::function<std::string()>& body) {
  int fds[2];
  if (::pipe(fds) != 0) return "pipe failed";
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    std::string out = body();
    ssize_t n = ::write(fds[1], out.data(), out.size());
    ::_exit(n == static_cast<ssize_t>(out.size()) ? 0 : 1);
  }
  ::close(fds[1]);
  std::string out;
  char buf[512];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) out += " (child exited abnormally)";
  return out;
}

// The value of a "Key:\t..." line of /proc/self/status.
std::string proc_status(const std::string& key) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind(key + ":", 0) == 0) return line.substr(key.size() + 1);
  return "?";
}

class PrivilegesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root (it tests the switch away from root)";
    accounts_ = unprivileged_accounts();
    ASSERT_GE(accounts_.size(), 2u) << "needs two unprivileged users in the passwd database";
  }
  std::vector<Account> accounts_;
};

TEST_F(PrivilegesTest, SwitchesForGoodAndKeepsNoCapabilities) {
  const Account a = accounts_.front();
  std::string failures = in_child([&] {
    std::ostringstream err;
    // Root's group as a supplementary group, as a login shell has it, so there is something to shed.
    gid_t roots[] = {0};
    if (::setgroups(1, roots) != 0) return std::string("setgroups in the test failed");
    auto d = drop_privileges(a.user, "");
    if (!d) return "drop_privileges: " + d.message();
    if (!d->switched) err << "switched is false; ";
    uid_t r, e, s;
    gid_t rg, eg, sg;
    ::getresuid(&r, &e, &s);
    ::getresgid(&rg, &eg, &sg);
    if (r != a.uid || e != a.uid || s != a.uid) err << "uids " << r << "," << e << "," << s << "; ";
    if (rg != a.gid || eg != a.gid || sg != a.gid) err << "gids " << rg << "," << eg << "," << sg << "; ";
    gid_t groups[256];
    int n = ::getgroups(256, groups);
    if (n < 0 || std::vector<gid_t>(groups, groups + n) != d->groups) err << "supplementary groups differ; ";
    for (int i = 0; i < n; ++i)
      if (groups[i] == 0) err << "root's group is still a supplementary group; ";
    if (::setuid(0) == 0) err << "setuid(0) succeeded; ";
    if (::seteuid(0) == 0) err << "seteuid(0) succeeded; ";
    if (::setgid(0) == 0) err << "setgid(0) succeeded; ";
    for (const char* key : {"CapEff", "CapPrm", "CapInh", "CapAmb"}) {
      std::string v = proc_status(key);
      if (v.find_first_not_of("\t 0") != std::string::npos) err << key << " is" << v << "; ";
    }
    if (::prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) != 1) err << "no_new_privs is not set; ";
    if (describe(*d).find("(" + a.user + ")") == std::string::npos) err << "describe: " << describe(*d) << "; ";
    return err.str();
  });
  EXPECT_EQ(failures, "") << "as " << a.user;
}

TEST_F(PrivilegesTest, ProxyGroupReplacesThePrimaryGroup) {
  const Account a = accounts_.front();
  const Account other = accounts_.back();
  ASSERT_NE(a.gid, other.gid) << "the accounts found share a primary group";
  std::string failures = in_child([&]() -> std::string {
    auto d = drop_privileges(a.user, other.group);
    if (!d) return "drop_privileges: " + d.message();
    if (::getgid() != other.gid || ::getegid() != other.gid) return "gid " + std::to_string(::getegid());
    if (::getuid() != a.uid) return "uid " + std::to_string(::getuid());
    return "";
  });
  EXPECT_EQ(failures, "");
}

TEST_F(PrivilegesTest, WithoutRootOnlyTheSameUserIsFine) {
  const Account a = accounts_.front();
  const Account b = accounts_.back();
  ASSERT_NE(a.uid, b.uid);
  std::string failures = in_child([&]() -> std::string {
    auto first = drop_privileges(a.user, "");
    if (!first) return "first drop: " + first.message();
    // Started as proxy.user already (a unit with User=): nothing to do, and that is no error.
    auto same = drop_privileges(a.user, "");
    if (!same) return "same user: " + same.message();
    if (same->switched) return "same user: switched is true";
    // Anyone else cannot be reached without root: a clear error that names the key and both users.
    auto other = drop_privileges(b.user, "");
    if (other) return "switching to another user without root succeeded";
    if (other.error() != Error::kPermissionDenied) return "error code " + std::string(error_name(other.error()));
    const std::string parts[] = {"proxy.user = \"" + b.user + "\"", "uid " + std::to_string(a.uid), "not as root"};
    for (const std::string& part : parts)
      if (other.message().find(part) == std::string::npos) return "message lacks '" + part + "': " + other.message();
    if (::getuid() != a.uid) return "uid changed to " + std::to_string(::getuid());
    return "";
  });
  EXPECT_EQ(failures, "");
}

TEST_F(PrivilegesTest, UnknownUserOrGroupIsAnErrorAndNothingChanges) {
  std::string failures = in_child([&]() -> std::string {
    auto d = drop_privileges("sg-no-such-account-3f9c", "");
    if (d || d.message().find("proxy.user: no user named") == std::string::npos) return "user: " + d.message();
    auto g = drop_privileges(accounts_.front().user, "sg-no-such-account-3f9c");
    if (g || g.message().find("proxy.group: no group named") == std::string::npos) return "group: " + g.message();
    if (::geteuid() != 0) return "the process is no longer root after failed switches";
    return "";
  });
  EXPECT_EQ(failures, "");
}

}  // namespace
}  // namespace sg
