#include "snapshot/layer_writer.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <filesystem>
#include <map>

#include "snapshot/layer_store.h"
#include "snapshot/tar_reader.h"
#include "tests/unit/snapshot/archive_builder.h"

namespace sg::snapshot {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

constexpr uid_t kBase = 2'000'000'000;
constexpr IdShift kShift{kBase, 65536};

struct TarEntry {
  mode_t type = 0;
  int64_t uid = -1, gid = -1;
  std::string hardlink;
};

std::map<std::string, TarEntry> read_tar(const std::string& path) {
  std::map<std::string, TarEntry> out;
  auto reader = TarReader::open(path, path, 1000);
  EXPECT_TRUE(reader) << reader.message();
  if (!reader) return out;
  for (;;) {
    auto next = reader->next();
    EXPECT_TRUE(next) << next.message();
    if (!next || *next == nullptr) break;
    archive_entry* e = *next;
    const char* link = archive_entry_hardlink(e);
    std::string name = archive_entry_pathname(e);
    if (name.ends_with("/")) name.pop_back();  // tar writes directories as "dir/"
    out[name] = {archive_entry_filetype(e), archive_entry_uid(e), archive_entry_gid(e),
                                      link != nullptr ? link : ""};
  }
  return out;
}

class LayerWriterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(tmp_.path().empty());
    upper_ = tmp_.path() + "/upper";
    fs::create_directories(upper_);
  }
  // A file in the upper dir owned by image id `id` (host kBase + id).
  void make_file(const std::string& rel, const std::string& content, uid_t id) {
    testing::write_file(upper_ + "/" + rel, content);
    ASSERT_EQ(::lchown((upper_ + "/" + rel).c_str(), kBase + id, kBase + id), 0);
  }
  void make_dir(const std::string& rel, uid_t id) {
    fs::create_directories(upper_ + "/" + rel);
    ASSERT_EQ(::lchown((upper_ + "/" + rel).c_str(), kBase + id, kBase + id), 0);
  }
  Result<WrittenLayer> seal(const std::string& out, uint64_t max_entries = 1000) {
    return write_layer({LayerSource::Kind::kOverlayUpper, upper_, "", kShift, max_entries}, tmp_.path() + "/" + out);
  }

  TempDir tmp_;
  std::string upper_;
};

TEST_F(LayerWriterTest, OwnersAreShiftedBackToImageIds) {
  make_dir("home", 0);
  make_dir("home/user", 1000);
  make_file("home/user/notes", "hi", 1000);
  make_file("root-file", "r", 0);
  ASSERT_EQ(::symlink("notes", (upper_ + "/home/user/link").c_str()), 0);
  ASSERT_EQ(::lchown((upper_ + "/home/user/link").c_str(), kBase + 1000, kBase + 1000), 0);
  auto layer = seal("l.tar");
  ASSERT_TRUE(layer) << layer.message();
  EXPECT_EQ(layer->entries, 5u);
  EXPECT_EQ(layer->digest, testing::digest_of(tmp_.path() + "/l.tar"));
  auto entries = read_tar(tmp_.path() + "/l.tar");
  ASSERT_EQ(entries.size(), 5u);
  EXPECT_EQ(entries["home"].uid, 0);
  EXPECT_EQ(entries["home/user"].uid, 1000);
  EXPECT_EQ(entries["home/user/notes"].uid, 1000);
  EXPECT_EQ(entries["home/user/notes"].gid, 1000);
  EXPECT_EQ(entries["home/user/link"].type, static_cast<mode_t>(AE_IFLNK));
  EXPECT_EQ(entries["root-file"].uid, 0);
}

TEST_F(LayerWriterTest, OverlayWhiteoutsAndOpaqueDirsBecomeOciEntries) {
  make_dir("etc", 0);
  ASSERT_EQ(::mknod((upper_ + "/etc/motd").c_str(), S_IFCHR | 0000, makedev(0, 0)), 0);
  make_dir("var", 0);
  make_dir("var/cache", 0);
  ASSERT_EQ(::setxattr((upper_ + "/var/cache").c_str(), "trusted.overlay.opaque", "y", 1, 0), 0);
  make_file("var/cache/new", "n", 0);
  auto layer = seal("l.tar");
  ASSERT_TRUE(layer) << layer.message();
  auto entries = read_tar(tmp_.path() + "/l.tar");
  ASSERT_TRUE(entries.count("etc/.wh.motd")) << "no whiteout entry";
  EXPECT_EQ(entries["etc/.wh.motd"].type, static_cast<mode_t>(AE_IFREG));
  EXPECT_EQ(entries.count("etc/motd"), 0u);
  EXPECT_TRUE(entries.count("var/cache/.wh..wh..opq"));
  EXPECT_TRUE(entries.count("var/cache/new"));

  // The store reads it back into the same overlayfs form.
  auto store = LayerStore::open(tmp_.path() + "/layers");
  ASSERT_TRUE(store) << store.message();
  auto added = store->add(tmp_.path() + "/l.tar", layer->digest, "sealed");
  ASSERT_TRUE(added) << added.message();
  struct stat st{};
  ASSERT_EQ(::lstat((store->tree_path(*added) + "/etc/motd").c_str(), &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  EXPECT_EQ(st.st_rdev, makedev(0, 0));
  char v[2] = {};
  EXPECT_EQ(::getxattr((store->tree_path(*added) + "/var/cache").c_str(), "trusted.overlay.opaque", v, sizeof v), 1);
}

TEST_F(LayerWriterTest, AnOwnerOutsideTheRangeIsNamed) {
  testing::write_file(upper_ + "/stray", "x");
  ASSERT_EQ(::chown((upper_ + "/stray").c_str(), 0, 0), 0);
  auto layer = seal("l.tar");
  ASSERT_FALSE(layer);
  EXPECT_EQ(layer.error(), Error::kInvalidArgument);
  EXPECT_NE(layer.message().find("'/stray' is owned by host 0:0, outside"), std::string::npos) << layer.message();
}

TEST_F(LayerWriterTest, HardLinksStayLinksAndTheSameTreeGivesTheSameDigest) {
  make_file("a", "same inode", 0);
  ASSERT_EQ(::link((upper_ + "/a").c_str(), (upper_ + "/b").c_str()), 0);
  auto one = seal("one.tar");
  auto two = seal("two.tar");
  ASSERT_TRUE(one && two);
  EXPECT_EQ(one->digest, two->digest);
  auto entries = read_tar(tmp_.path() + "/one.tar");
  EXPECT_EQ(entries["b"].hardlink, "a");
}

TEST_F(LayerWriterTest, AnEmptyUpperIsNoLayer) {
  auto layer = seal("l.tar");
  ASSERT_TRUE(layer) << layer.message();
  EXPECT_EQ(layer->entries, 0u);
  EXPECT_EQ(layer->digest, "");
}

TEST_F(LayerWriterTest, TheEntryBoundIsALimit) {
  make_file("a", "1", 0);
  make_file("b", "2", 0);
  make_file("c", "3", 0);
  auto layer = seal("l.tar", 2);
  ASSERT_FALSE(layer);
  EXPECT_EQ(layer.error(), Error::kLimitExceeded);
}

TEST_F(LayerWriterTest, CopiesAreOwnedByImageRoot) {
  std::string src = tmp_.path() + "/src";
  fs::create_directories(src + "/sub");
  testing::write_file(src + "/sub/f", "data");
  ASSERT_EQ(::chown((src + "/sub/f").c_str(), 1234, 1234), 0);
  testing::write_file(tmp_.path() + "/single", "one");
  auto dir = write_layer({LayerSource::Kind::kCopy, src, "/app", {}, 100}, tmp_.path() + "/dir.tar");
  ASSERT_TRUE(dir) << dir.message();
  auto entries = read_tar(tmp_.path() + "/dir.tar");
  ASSERT_TRUE(entries.count("app/sub/f"));
  EXPECT_EQ(entries["app/sub/f"].uid, 0);
  EXPECT_EQ(entries["app"].type, static_cast<mode_t>(AE_IFDIR));
  auto file = write_layer({LayerSource::Kind::kCopy, tmp_.path() + "/single", "/etc/", {}, 100}, tmp_.path() + "/f.tar");
  ASSERT_TRUE(file) << file.message();
  EXPECT_TRUE(read_tar(tmp_.path() + "/f.tar").count("etc/single"));
  auto bad = write_layer({LayerSource::Kind::kCopy, src, "/../x", {}, 100}, tmp_.path() + "/bad.tar");
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error(), Error::kInvalidArgument);
}

}  // namespace
}  // namespace sg::snapshot
