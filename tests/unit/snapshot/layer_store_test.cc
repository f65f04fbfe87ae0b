#include "snapshot/layer_store.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>

#include <filesystem>

#include "tests/unit/snapshot/archive_builder.h"

namespace sg::snapshot {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

class LayerStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(tmp_.path().empty());
    auto s = LayerStore::open(tmp_.path() + "/layers");
    ASSERT_TRUE(s) << s.message();
    store_.emplace(std::move(*s));
  }
  // A layer tar written outside the store (the test's "archive" dir).
  std::string blob(const std::string& name, const std::vector<testing::Entry>& entries, bool gzip = false) {
    fs::create_directories(tmp_.path() + "/in");
    std::string path = tmp_.path() + "/in/" + name;
    EXPECT_TRUE(testing::write_tar(path, entries, gzip));
    return path;
  }
  Result<std::string> add(const std::string& path) { return store_->add(path, testing::digest_of(path), "test layer"); }

  TempDir tmp_;
  std::optional<LayerStore> store_;
};

TEST_F(LayerStoreTest, AddVerifiesAndUnpacksIntoTheDigestsDirectory) {
  std::string path = blob("l.tar", {testing::dir("etc"), testing::file("etc/hostname", "box\n"),
                                    testing::symlink("etc/alias", "/etc/hostname"), testing::hardlink("etc/again", "etc/hostname")});
  std::string digest = testing::digest_of(path);
  auto added = add(path);
  ASSERT_TRUE(added) << added.message();
  EXPECT_EQ(*added, digest);
  EXPECT_TRUE(store_->contains(digest));
  EXPECT_EQ(store_->layer_dir(digest), store_->root() + "/sha256/" + digest.substr(7));
  EXPECT_EQ(testing::read_file(store_->tree_path(digest) + "/etc/hostname"), "box\n");
  EXPECT_EQ(testing::read_file(store_->tree_path(digest) + "/etc/again"), "box\n");
  EXPECT_EQ(fs::read_symlink(store_->tree_path(digest) + "/etc/alias"), "/etc/hostname");
  EXPECT_EQ(testing::digest_of(store_->layer_dir(digest) + "/blob"), digest);
  EXPECT_TRUE(store_->verify(digest));
  auto listed = store_->list();
  ASSERT_TRUE(listed);
  EXPECT_EQ(*listed, std::vector<std::string>{digest});
}

// No layer fills the store's disk: past the reserve the add stops, names the entry and keeps nothing.
TEST_F(LayerStoreTest, ALayerThatWouldEatTheFreeSpaceReserveIsRefused) {
  store_->set_free_space_reserve(uint64_t{1} << 62);  // more than any disk has free
  std::string path = blob("big.tar", {testing::dir("data"), testing::file("data/payload", std::string(65536, 'x'))});
  auto added = add(path);
  ASSERT_FALSE(added);
  EXPECT_EQ(added.error(), Error::kLimitExceeded);
  EXPECT_NE(added.message().find("test layer: entry 'data"), std::string::npos) << added.message();
  EXPECT_NE(added.message().find("node.store_free_space_reserve_mb"), std::string::npos) << added.message();
  EXPECT_TRUE(store_->list()->empty());
  EXPECT_TRUE(fs::is_empty(store_->root() + "/tmp"));
  std::string again = blob("big2.tar", {testing::dir("data"), testing::file("data/payload", std::string(65536, 'x'))});
  store_->set_free_space_reserve(0);
  EXPECT_TRUE(add(again));
}

TEST_F(LayerStoreTest, GzipLayersAreUnpacked) {
  std::string path = blob("l.tar.gz", {testing::file("a", "compressed")}, true);
  auto added = add(path);
  ASSERT_TRUE(added) << added.message();
  EXPECT_EQ(testing::read_file(store_->tree_path(*added) + "/a"), "compressed");
}

TEST_F(LayerStoreTest, CorruptedBlobIsRefusedNamingTheDigest) {
  std::string path = blob("l.tar", {testing::file("a", "x")});
  std::string claimed = "sha256:" + std::string(64, 'a');
  auto added = store_->add(path, claimed, "archive.tar: layer 1");
  ASSERT_FALSE(added);
  EXPECT_EQ(added.error(), Error::kInvalidArgument);
  EXPECT_NE(added.message().find("archive.tar: layer 1"), std::string::npos) << added.message();
  EXPECT_NE(added.message().find("digest mismatch"), std::string::npos) << added.message();
  EXPECT_NE(added.message().find(claimed), std::string::npos) << added.message();
  EXPECT_NE(added.message().find(testing::digest_of(path)), std::string::npos) << added.message();
  EXPECT_FALSE(store_->contains(claimed));
  EXPECT_TRUE(store_->list()->empty());
  EXPECT_FALSE(store_->add(path, "md5:1234", "x"));
}

TEST_F(LayerStoreTest, VerifyNoticesAStoredBlobThatChanged) {
  auto added = add(blob("l.tar", {testing::file("a", "x")}));
  ASSERT_TRUE(added);
  testing::write_file(store_->layer_dir(*added) + "/blob", "tampered");
  auto v = store_->verify(*added);
  ASSERT_FALSE(v);
  EXPECT_NE(v.message().find(*added), std::string::npos);
}

TEST_F(LayerStoreTest, AnInterruptedImportIsNeverUsedAndIsCleanedOnOpen) {
  std::string path = blob("l.tar", {testing::file("a", "x")});
  std::string digest = testing::digest_of(path);
  // What a crash mid-unpack leaves: a temp layer with a partial tree, never renamed into sha256/.
  auto tmp = store_->make_temp_dir("layer-");
  ASSERT_TRUE(tmp);
  fs::create_directories(*tmp + "/tree");
  testing::write_file(*tmp + "/tree/half", "partial");
  fs::copy_file(path, *tmp + "/blob");
  EXPECT_FALSE(store_->contains(digest));
  auto reopened = LayerStore::open(tmp_.path() + "/layers");
  ASSERT_TRUE(reopened) << reopened.message();
  EXPECT_FALSE(fs::exists(*tmp));
  EXPECT_TRUE(fs::is_empty(reopened->root() + "/tmp"));
  EXPECT_FALSE(reopened->contains(digest));
  // The next import of that layer builds it from scratch.
  auto added = reopened->add(path, digest, "l");
  ASSERT_TRUE(added) << added.message();
  EXPECT_FALSE(fs::exists(reopened->tree_path(digest) + "/half"));
  EXPECT_EQ(testing::read_file(reopened->tree_path(digest) + "/a"), "x");
}

TEST_F(LayerStoreTest, WhiteoutsAndOpaqueDirectoriesBecomeOverlayfsForm) {
  std::string path = blob("l.tar", {testing::dir("etc"), testing::file("etc/.wh.passwd", ""),
                                    testing::file("var/.wh..wh..opq", ""), testing::file("var/new", "n"),
                                    testing::file("gone/.wh.deep", "")});
  auto added = add(path);
  ASSERT_TRUE(added) << added.message();
  std::string tree = store_->tree_path(*added);
  struct stat st{};
  ASSERT_EQ(::lstat((tree + "/etc/passwd").c_str(), &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  EXPECT_EQ(st.st_rdev, makedev(0, 0));
  ASSERT_EQ(::lstat((tree + "/gone/deep").c_str(), &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  EXPECT_FALSE(fs::exists(tree + "/etc/.wh.passwd"));
  EXPECT_FALSE(fs::exists(tree + "/var/.wh..wh..opq"));
  char value[8] = {};
  ASSERT_EQ(::getxattr((tree + "/var").c_str(), "trusted.overlay.opaque", value, sizeof value), 1);
  EXPECT_EQ(value[0], 'y');
  EXPECT_EQ(testing::read_file(tree + "/var/new"), "n");
  EXPECT_LT(::getxattr((tree + "/etc").c_str(), "trusted.overlay.opaque", value, sizeof value), 0);
}

TEST_F(LayerStoreTest, PathTraversalIsRefusedNamingTheEntry) {
  std::string outside = tmp_.path() + "/outside";
  fs::create_directories(outside);
  testing::write_file(outside + "/victim", "keep");
  struct Case {
    std::vector<testing::Entry> entries;
    std::string named;
  };
  std::vector<Case> cases = {
      {{testing::file("../evil", "x")}, "../evil"},
      {{testing::file("a/../../evil", "x")}, "a/../../evil"},
      {{testing::file("/abs", "x")}, "/abs"},
      {{testing::hardlink("h", "../../outside/victim")}, "h"},
      // A symlink out of the layer, then entries that would go through it.
      {{testing::symlink("link", outside), testing::file("link/pwned", "x")}, "link/pwned"},
      {{testing::symlink("link", outside), testing::file("link/.wh.victim", "")}, "link/.wh.victim"},
      {{testing::symlink("link", outside), testing::file("link/.wh..wh..opq", "")}, "link/.wh..wh..opq"},
  };
  int n = 0;
  for (const Case& c : cases) {
    std::string path = blob("bad" + std::to_string(n++) + ".tar", c.entries);
    auto added = add(path);
    ASSERT_FALSE(added) << c.named;
    EXPECT_NE(added.message().find("test layer"), std::string::npos) << added.message();
    EXPECT_NE(added.message().find(c.named), std::string::npos) << added.message();
    EXPECT_FALSE(store_->contains(testing::digest_of(path)));
  }
  EXPECT_EQ(testing::read_file(outside + "/victim"), "keep");
  EXPECT_FALSE(fs::exists(outside + "/pwned"));
  EXPECT_FALSE(fs::exists(tmp_.path() + "/evil"));
  EXPECT_TRUE(store_->list()->empty());
  EXPECT_TRUE(fs::is_empty(store_->root() + "/tmp"));  // failed layers leave nothing behind
}

TEST_F(LayerStoreTest, ReimportingALayerSharesTheStoredOne) {
  std::string first = blob("one.tar", {testing::file("a", "same")});
  auto a = add(first);
  ASSERT_TRUE(a);
  struct stat before{};
  ASSERT_EQ(::stat(store_->tree_path(*a).c_str(), &before), 0);
  std::string second = blob("two.tar", {testing::file("a", "same")});
  auto b = add(second);
  ASSERT_TRUE(b) << b.message();
  EXPECT_EQ(*a, *b);
  struct stat after{};
  ASSERT_EQ(::stat(store_->tree_path(*b).c_str(), &after), 0);
  EXPECT_EQ(before.st_ino, after.st_ino);  // not unpacked again
  EXPECT_EQ(store_->list()->size(), 1u);
  ASSERT_TRUE(store_->remove(*a));
  EXPECT_FALSE(store_->contains(*a));
  EXPECT_EQ(store_->remove(*a).error(), Error::kNotFound);
}

TEST(NormalizeRelative, CleansAndRefuses) {
  EXPECT_EQ(normalize_relative("./a//b/", false), "a/b");
  EXPECT_EQ(normalize_relative("./", false), "");
  EXPECT_EQ(normalize_relative("a/../b", false), std::nullopt);
  EXPECT_EQ(normalize_relative("a/../b", true), "b");
  EXPECT_EQ(normalize_relative("l1/../l0/layer.tar", true), "l0/layer.tar");
  EXPECT_EQ(normalize_relative("../b", true), std::nullopt);
  EXPECT_EQ(normalize_relative("a/../../b", true), std::nullopt);
  EXPECT_EQ(normalize_relative("/etc", true), std::nullopt);
}

TEST(DurableWrite, ReplacesTheFileAtomically) {
  TempDir tmp;
  std::string path = tmp.path() + "/f.json";
  ASSERT_TRUE(write_file_atomic(path, "one"));
  ASSERT_TRUE(write_file_atomic(path, "two"));
  EXPECT_EQ(testing::read_file(path), "two");
  size_t files = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(tmp.path())) ++files;
  EXPECT_EQ(files, 1u);  // no temp file left over
}

}  // namespace
}  // namespace sg::snapshot
