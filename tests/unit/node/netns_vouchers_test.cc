// The node's marks for the proxy's socket maker, checked with the maker's own check (check_vouched), on
// sockets made inside the namespaces this test creates. Root only (namespaces, root-owned marks).
#include "noderuntime/netns_vouchers.h"

#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <optional>

#include "common/fd.h"
#include "common/vouched_netns.h"
#include "tests/netns.h"
#include "tests/unit/temp_dir.h"

namespace sg {
namespace {

UniqueFd socket_in(const testing::Netns& ns) {
  return testing::in_netns(ns.path(), [] { return UniqueFd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)); });
}

class NetnsVouchersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "network namespaces and root's marks need root";
    ASSERT_FALSE(tmp_.path().empty());
    dir_ = tmp_.path() + "/node.sock.netns";
  }
  testing::TempDir tmp_{"vouchers"};
  std::string dir_;
};

TEST_F(NetnsVouchersTest, MarksTheNamespaceOfEachSandboxUntilAnythingAboutItChanges) {
  NetnsVouchers vouchers(dir_);
  testing::Netns first, second;
  ASSERT_TRUE(first.valid() && second.valid());
  UniqueFd a = socket_in(first), b = socket_in(second);
  ASSERT_TRUE(a.valid() && b.valid());
  EXPECT_FALSE(check_vouched(dir_, a.get())) << "nothing vouched for yet";
  ASSERT_TRUE(vouchers.vouch("sb-1", a.get())) << "the directory is made when missing";
  struct stat st{};
  ASSERT_EQ(::stat(dir_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0755u);
  EXPECT_TRUE(check_vouched(dir_, a.get()));
  EXPECT_FALSE(check_vouched(dir_, b.get())) << "one namespace, not every one";
  ASSERT_TRUE(vouchers.vouch("sb-1", a.get())) << "again: nothing changes";
  ASSERT_TRUE(vouchers.vouch("sb-1", b.get())) << "a new instance of the sandbox, in a new namespace";
  EXPECT_FALSE(check_vouched(dir_, a.get())) << "the old instance's mark went";
  EXPECT_TRUE(check_vouched(dir_, b.get()));
  vouchers.revoke("sb-1");
  EXPECT_FALSE(check_vouched(dir_, b.get()));
  vouchers.revoke("sb-1");  // twice: nothing to do
  EXPECT_TRUE(std::filesystem::is_empty(dir_));
}

// A mark outlives its namespace while the node is down (a sandbox may exit meanwhile): it must match no
// namespace made later, whatever inode number that one gets.
TEST_F(NetnsVouchersTest, AMarkLeftForAGoneNamespaceMatchesNoLaterOne) {
  NetnsVouchers vouchers(dir_);
  {
    std::optional<testing::Netns> gone;
    gone.emplace();
    UniqueFd sock = socket_in(*gone);
    ASSERT_TRUE(vouchers.vouch("sb-1", sock.get()));
  }  // the namespace's last holders are gone; its mark stays (the node is "down": no revoke)
  for (int i = 0; i < 20; ++i) {  // enough new namespaces that one likely reuses the inode number
    testing::Netns later;
    UniqueFd sock = socket_in(later);
    ASSERT_TRUE(sock.valid());
    EXPECT_FALSE(check_vouched(dir_, sock.get())) << i;
  }
}

TEST_F(NetnsVouchersTest, ANodeStartingVouchesForNothingAnEarlierOneDid) {
  testing::Netns ns;
  UniqueFd sock = socket_in(ns);
  NetnsVouchers before(dir_);
  ASSERT_TRUE(before.vouch("sb-1", sock.get()));
  ASSERT_EQ(::chmod(dir_.c_str(), 0777), 0);  // as an existing directory might be
  const mode_t old_umask = ::umask(077);
  NetnsVouchers after(dir_);
  EXPECT_TRUE(after.reset());
  ::umask(old_umask);
  EXPECT_FALSE(check_vouched(dir_, sock.get()));
  EXPECT_TRUE(std::filesystem::is_empty(dir_));
  struct stat st{};
  ASSERT_EQ(::stat(dir_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0755u) << "whatever it was and whatever the umask: the maker runs as another user";
  // A link in the directory's place is not followed by root.
  ASSERT_EQ(::rmdir(dir_.c_str()), 0);
  ASSERT_EQ(::symlink(tmp_.path().c_str(), dir_.c_str()), 0);
  EXPECT_FALSE(after.reset());
  EXPECT_TRUE(std::filesystem::exists(tmp_.path())) << "what the link named is untouched";
}

TEST_F(NetnsVouchersTest, OnlyRootsMarksInDirectoriesOnlyRootWrites) {
  NetnsVouchers vouchers(dir_);
  UniqueFd own(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(vouchers.vouch("sb-1", own.get()));
  ASSERT_TRUE(check_vouched(dir_, own.get()));
  ASSERT_EQ(::chmod(dir_.c_str(), 0775), 0);
  EXPECT_FALSE(check_vouched(dir_, own.get())) << "a group could add marks";
  ASSERT_EQ(::chmod(dir_.c_str(), 0755), 0);
  ASSERT_EQ(::chmod(tmp_.path().c_str(), 0777), 0);
  EXPECT_FALSE(check_vouched(dir_, own.get())) << "anyone could rename the directory and put another in its place";
  ASSERT_EQ(::chmod(tmp_.path().c_str(), 01777), 0);
  EXPECT_TRUE(check_vouched(dir_, own.get())) << "sticky, as /tmp: only root renames root's entries";
  ASSERT_EQ(::chmod(tmp_.path().c_str(), 0700), 0);
  const std::string mark = dir_ + "/" + netns_mark_name(*netns_cookie(own.get()));
  ASSERT_EQ(::chown(mark.c_str(), 65534, 65534), 0);
  EXPECT_FALSE(check_vouched(dir_, own.get())) << "a mark someone else made";
  EXPECT_EQ(vouched_netns_dir(*parse_endpoint("unix:/run/sandgate/node.sock")), "/run/sandgate/node.sock.netns");
  EXPECT_EQ(vouched_netns_dir(*parse_endpoint("127.0.0.1:7070")), "");
}

TEST_F(NetnsVouchersTest, NothingWithoutADirectory) {
  NetnsVouchers none("");
  UniqueFd own(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  EXPECT_TRUE(none.vouch("sb-1", own.get())) << "a node without a unix socket vouches for nothing, quietly";
  UniqueFd file(::open("/proc/self/status", O_RDONLY | O_CLOEXEC));
  NetnsVouchers vouchers(dir_);
  EXPECT_FALSE(vouchers.vouch("sb-1", file.get())) << "not a socket: no namespace cookie";
}

}  // namespace
}  // namespace sg
