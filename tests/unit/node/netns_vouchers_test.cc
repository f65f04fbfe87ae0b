// The node's marks for the proxy's socket maker, checked with the maker's own check (check_vouched).
#include "noderuntime/netns_vouchers.h"

#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "common/fd.h"
#include "common/vouched_netns.h"
#include "tests/netns.h"
#include "tests/unit/temp_dir.h"

namespace sg {
namespace {

UniqueFd open_netns(const std::string& path) { return UniqueFd(::open(path.c_str(), O_RDONLY | O_CLOEXEC)); }

TEST(NetnsVouchers, MarksTheNamespaceOfEachSandboxUntilAnythingAboutItChanges) {
  testing::TempDir tmp("vouchers");
  const std::string dir = tmp.path() + "/node.sock.netns";
  NetnsVouchers vouchers(dir);
  testing::Netns first, second;
  ASSERT_TRUE(first.valid() && second.valid());
  UniqueFd a = open_netns(first.path()), b = open_netns(second.path());
  EXPECT_FALSE(check_vouched(dir, a.get())) << "nothing vouched for yet";
  ASSERT_TRUE(vouchers.vouch("sb-1", a.get())) << "the directory is made when missing";
  struct stat st{};
  ASSERT_EQ(::stat(dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0755u);
  EXPECT_TRUE(check_vouched(dir, a.get()));
  EXPECT_FALSE(check_vouched(dir, b.get())) << "one namespace, not every one";
  ASSERT_TRUE(vouchers.vouch("sb-1", a.get())) << "again: nothing changes";
  ASSERT_TRUE(vouchers.vouch("sb-1", b.get())) << "a new instance of the sandbox, in a new namespace";
  EXPECT_FALSE(check_vouched(dir, a.get())) << "the old instance's mark went";
  EXPECT_TRUE(check_vouched(dir, b.get()));
  vouchers.revoke("sb-1");
  EXPECT_FALSE(check_vouched(dir, b.get()));
  vouchers.revoke("sb-1");  // twice: nothing to do
  EXPECT_TRUE(std::filesystem::is_empty(dir));
}

TEST(NetnsVouchers, ANodeStartingVouchesForNothingAnEarlierOneDid) {
  testing::TempDir tmp("vouchers");
  const std::string dir = tmp.path() + "/node.sock.netns";
  testing::Netns ns;
  UniqueFd fd = open_netns(ns.path());
  NetnsVouchers before(dir);
  ASSERT_TRUE(before.vouch("sb-1", fd.get()));
  const mode_t old_umask = ::umask(077);
  NetnsVouchers after(dir);
  EXPECT_TRUE(after.reset());
  ::umask(old_umask);
  EXPECT_FALSE(check_vouched(dir, fd.get()));
  EXPECT_TRUE(std::filesystem::is_empty(dir));
  struct stat st{};
  ASSERT_EQ(::stat(dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0755u) << "whatever the umask: the maker runs as another user";
}

TEST(NetnsVouchers, OnlyNetworkNamespacesAndNothingWithoutADirectory) {
  testing::TempDir tmp("vouchers");
  const std::string dir = tmp.path() + "/node.sock.netns";
  NetnsVouchers vouchers(dir);
  UniqueFd mount_ns = open_netns("/proc/self/ns/mnt");
  UniqueFd file(::open("/proc/self/status", O_RDONLY | O_CLOEXEC));
  EXPECT_FALSE(vouchers.vouch("sb-1", mount_ns.get()));
  EXPECT_FALSE(vouchers.vouch("sb-1", file.get()));
  EXPECT_FALSE(std::filesystem::exists(dir) && !std::filesystem::is_empty(dir));
  NetnsVouchers none("");
  UniqueFd own = open_netns("/proc/self/ns/net");
  EXPECT_TRUE(none.vouch("sb-1", own.get())) << "a node without a unix socket vouches for nothing, quietly";
}

// The maker's side: a mark counts only in a directory only root writes, and only if root made it.
TEST(VouchedNetns, AMarkCountsOnlyIfRootMadeItWhereOnlyRootWrites) {
  testing::TempDir tmp("vouchers");
  const std::string dir = tmp.path() + "/node.sock.netns";
  NetnsVouchers vouchers(dir);
  UniqueFd own = open_netns("/proc/self/ns/net");
  ASSERT_TRUE(vouchers.vouch("sb-1", own.get()));
  ASSERT_TRUE(check_vouched(dir, own.get()));
  ASSERT_EQ(::chmod(dir.c_str(), 0775), 0);
  EXPECT_FALSE(check_vouched(dir, own.get())) << "a group could add marks";
  ASSERT_EQ(::chmod(dir.c_str(), 0755), 0);
  const std::string mark = dir + "/" + *netns_mark_name(own.get());
  if (::geteuid() == 0) {
    ASSERT_EQ(::chown(mark.c_str(), 65534, 65534), 0);
    EXPECT_FALSE(check_vouched(dir, own.get())) << "a mark someone else made";
  }
  EXPECT_EQ(vouched_netns_dir(*parse_endpoint("unix:/run/sandgate/node.sock")), "/run/sandgate/node.sock.netns");
  EXPECT_EQ(vouched_netns_dir(*parse_endpoint("127.0.0.1:7070")), "");
}

}  // namespace
}  // namespace sg
