#include "snapshot/checkpointer.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

#include <filesystem>
#include <thread>

#include "snapshot/checkpoint_delta.h"
#include "tests/unit/snapshot/archive_builder.h"
#include "tests/unit/temp_dir.h"

namespace sg::snapshot {
namespace {

namespace fs = std::filesystem;

// Records what the checkpoint did to the "sandbox"; can be told to fail.
class FakeFreezer final : public Freezer {
 public:
  Status freeze() override {
    ++freezes;
    if (fail_freeze) return fail(Error::kTimeout, "freeze did not complete");
    frozen = true;
    return {};
  }
  Status thaw() override {
    ++thaws;
    frozen = false;
    return {};
  }
  bool fail_freeze = false;
  bool frozen = false;
  int freezes = 0, thaws = 0;
};

class CheckpointerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(tmp_.path().empty());
    upper_ = tmp_.path() + "/sandbox/upper";
    fs::create_directories(upper_);
    auto snapshots = SnapshotStore::open(tmp_.path() + "/store/snapshots");
    ASSERT_TRUE(snapshots) << snapshots.message();
    snapshots_ = std::make_unique<SnapshotStore>(std::move(*snapshots));
    auto images = ImageStore::open(tmp_.path() + "/store", [s = snapshots_.get()] { return s->layers_in_use(); });
    ASSERT_TRUE(images) << images.message();
    images_ = std::move(*images);
  }

  CheckpointJob job() const {
    CheckpointJob j;
    j.upper_dir = upper_;
    j.shift = IdShift{0, 65536};  // the test's files are owned by root: image root
    j.index_path = tmp_.path() + "/sandbox/checkpoint.index";
    j.record.type = "filesystem";
    j.record.source_id = "sb-aaaaaaaaaaaa";
    j.record.driver = "process";
    j.record.image = "base";
    j.record.command = {"/bin/true"};
    return j;
  }
  Result<CheckpointResult> take() { return checkpoint(*images_, *snapshots_, job(), freezer_); }
  void write(const std::string& rel, const std::string& data) {
    fs::create_directories(fs::path(upper_ + "/" + rel).parent_path());
    testing::write_file(upper_ + "/" + rel, data);
  }
  std::string tree(const std::string& digest) const { return images_->layers().tree_path(digest); }
  size_t stored_layers() const { return images_->layers().list()->size(); }

  testing::TempDir tmp_;
  std::string upper_;
  std::unique_ptr<SnapshotStore> snapshots_;
  std::unique_ptr<ImageStore> images_;
  FakeFreezer freezer_;
};

TEST_F(CheckpointerTest, ASecondCheckpointHoldsOnlyWhatChangedAndWhiteoutsForWhatWent) {
  write("root/notes", "v1");
  write("root/big", std::string(4 * 1024 * 1024, 'x'));
  write("tmp/doomed", "bye");
  auto first = take();
  ASSERT_TRUE(first) << first.message();
  EXPECT_EQ(freezer_.freezes, 1);
  EXPECT_EQ(freezer_.thaws, 1);
  EXPECT_FALSE(freezer_.frozen);
  const Snapshot& a = first->snapshot;
  ASSERT_EQ(a.layers.size(), 1u);
  EXPECT_EQ(a.layer, a.layers[0]);
  EXPECT_GT(a.layer_bytes, 4u * 1024 * 1024);
  EXPECT_EQ(testing::read_file(tree(a.layer) + "/root/notes"), "v1");

  write("root/notes", "v2");
  ASSERT_EQ(::unlink((upper_ + "/tmp/doomed").c_str()), 0);
  auto second = take();
  ASSERT_TRUE(second) << second.message();
  const Snapshot& b = second->snapshot;
  ASSERT_EQ(b.layers.size(), 2u);
  EXPECT_EQ(b.layers[0], a.layer);
  EXPECT_LT(b.layer_bytes, 64u * 1024) << "the unchanged 4 MiB file was copied again";
  EXPECT_EQ(testing::read_file(tree(b.layer) + "/root/notes"), "v2");
  EXPECT_FALSE(fs::exists(tree(b.layer) + "/root/big"));
  struct stat st{};
  ASSERT_EQ(::lstat((tree(b.layer) + "/tmp/doomed").c_str(), &st), 0) << "no whiteout for the deleted file";
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  EXPECT_EQ(st.st_rdev, makedev(0, 0));

  // Both records are listed; the first snapshot still reads v1 (its own layer is untouched).
  EXPECT_EQ(snapshots_->list()->size(), 2u);
  EXPECT_EQ(testing::read_file(tree(a.layer) + "/root/notes"), "v1");

  // Nothing changed since: a snapshot with no new layer.
  auto third = take();
  ASSERT_TRUE(third) << third.message();
  EXPECT_EQ(third->entries, 0u);
  EXPECT_EQ(third->snapshot.layer, "");
  EXPECT_EQ(third->snapshot.layers, b.layers);
}

// A file written within a tick of the freeze would have the same ctime as one written again right after the
// thaw. The checkpoint holds the freeze until the clock has left that tick, so the file is recorded as
// clean, and the next checkpoint takes nothing (it used to copy the whole file again).
TEST_F(CheckpointerTest, AFileWrittenJustBeforeACheckpointIsNotCopiedAgainByTheNext) {
  write("root/big", std::string(1024 * 1024, 'x'));
  auto first = take();
  ASSERT_TRUE(first) << first.message();
  EXPECT_GT(first->snapshot.layer_bytes, 1024u * 1024);
  auto second = take();
  ASSERT_TRUE(second) << second.message();
  EXPECT_EQ(second->entries, 0u);
  EXPECT_EQ(second->snapshot.layer, "");
  // And a write right after a checkpoint is seen, whatever tick it falls in.
  write("root/big", std::string(1024 * 1024, 'y'));
  auto third = take();
  ASSERT_TRUE(third) << third.message();
  EXPECT_EQ(testing::read_file(tree(third->snapshot.layer) + "/root/big"), std::string(1024 * 1024, 'y'));
}

TEST_F(CheckpointerTest, AChainWhoseLayerWasRemovedStartsOverWithAFullLayer) {
  write("data", "one");
  auto first = take();
  ASSERT_TRUE(first) << first.message();
  ASSERT_TRUE(snapshots_->remove(first->snapshot.id));
  ASSERT_TRUE(images_->collect_unused());
  EXPECT_EQ(stored_layers(), 0u);
  write("other", "two");
  auto second = take();
  ASSERT_TRUE(second) << second.message();
  ASSERT_EQ(second->snapshot.layers.size(), 1u) << "stacked on a layer that is gone";
  EXPECT_EQ(testing::read_file(tree(second->snapshot.layer) + "/data"), "one");
  EXPECT_EQ(testing::read_file(tree(second->snapshot.layer) + "/other"), "two");
}

// The image "base" of one layer (/etc/os, /etc/doomed), as an image build would record it.
std::string add_base_image(ImageStore& images, const std::string& dir) {
  const std::string blob = dir + "/base.tar";
  EXPECT_TRUE(testing::write_tar(blob, {testing::dir("etc"), testing::file("etc/os", "debian"),
                                        testing::file("etc/doomed", "image file")}));
  auto digest = sha256_file(blob);
  EXPECT_TRUE(digest);
  auto added = images.add_pinned_layer(blob, *digest, "the test image");
  EXPECT_TRUE(added) << added.message();
  Image image;
  image.name = "base";
  image.format = "build";
  image.layers = {*added};
  auto created = images.create(image);
  EXPECT_TRUE(created) << created.message();
  images.unpin({*added});
  return *added;
}

// A long chain is flattened before the next checkpoint stacks on it: the layers above the image's become one,
// which shows the same tree (what they wrote, what they deleted from the image as whiteouts, an opaque
// directory's hiding); the new checkpoint is still only what changed, and the one after it stacks on the
// flattened chain (a delta, not a full layer).
TEST_F(CheckpointerTest, ALongChainIsFlattenedAboveTheImageAndTheDeltasGoOn) {
  const std::string image_layer = add_base_image(*images_, tmp_.path());
  CheckpointJob j = job();
  j.base_layers = {image_layer};
  j.max_layers_above_image = 3;
  auto take_j = [&] { return checkpoint(*images_, *snapshots_, j, freezer_); };
  write("root/a", "a1");
  write("root/big", std::string(1 << 20, 'x'));
  fs::create_directories(upper_ + "/cache");
  write("cache/old", "stale");
  auto one = take_j();
  ASSERT_TRUE(one) << one.message();
  write("root/a", "a2");
  fs::create_directories(upper_ + "/etc");
  ASSERT_EQ(::mknod((upper_ + "/etc/doomed").c_str(), S_IFCHR | 0000, makedev(0, 0)), 0) << "needs root";
  auto two = take_j();
  ASSERT_TRUE(two) << two.message();
  // The cache dir deleted and made again: overlayfs marks it opaque in the upper dir.
  fs::remove_all(upper_ + "/cache");
  fs::create_directories(upper_ + "/cache");
  ASSERT_EQ(::setxattr((upper_ + "/cache").c_str(), "trusted.overlay.opaque", "y", 1, 0), 0);
  write("cache/new", "fresh");
  auto three = take_j();
  ASSERT_TRUE(three) << three.message();
  ASSERT_EQ(three->snapshot.layers.size(), 4u);
  EXPECT_EQ(three->flattened, 0u);

  write("root/b", "b1");
  auto four = take_j();
  ASSERT_TRUE(four) << four.message();
  const Snapshot& flat = four->snapshot;
  EXPECT_EQ(four->flattened, 3u);
  ASSERT_EQ(flat.layers.size(), 3u) << "the image's layer, the flattened one, this checkpoint's";
  EXPECT_EQ(flat.layers[0], image_layer);
  EXPECT_EQ(flat.layer, flat.layers[2]);
  EXPECT_LT(flat.layer_bytes, 64u * 1024) << "the checkpoint after a flattening is still a delta";
  EXPECT_EQ(testing::read_file(tree(flat.layer) + "/root/b"), "b1");
  const std::string merged = tree(flat.layers[1]);
  EXPECT_EQ(testing::read_file(merged + "/root/a"), "a2");
  EXPECT_EQ(fs::file_size(merged + "/root/big"), 1u << 20);
  struct stat st{};
  ASSERT_EQ(::lstat((merged + "/etc/doomed").c_str(), &st), 0) << "the image file's deletion was lost";
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  EXPECT_EQ(st.st_rdev, makedev(0, 0));
  EXPECT_FALSE(fs::exists(merged + "/cache/old")) << "the opaque directory's hiding was lost";
  EXPECT_EQ(testing::read_file(merged + "/cache/new"), "fresh");
  char opaque[2] = {};
  EXPECT_EQ(::getxattr((merged + "/cache").c_str(), "trusted.overlay.opaque", opaque, sizeof opaque), 1);
  // The earlier snapshots keep their own chains; the next checkpoint stacks on the flattened one.
  EXPECT_EQ(snapshots_->get(three->snapshot.id)->layers, three->snapshot.layers);
  write("root/c", "c1");
  auto five = take_j();
  ASSERT_TRUE(five) << five.message();
  EXPECT_EQ(five->flattened, 0u);
  ASSERT_EQ(five->snapshot.layers.size(), 4u);
  EXPECT_EQ(std::vector<std::string>(five->snapshot.layers.begin(), five->snapshot.layers.begin() + 3), flat.layers);
  EXPECT_LT(five->snapshot.layer_bytes, 64u * 1024) << "stacked on a full layer, not on the flattened chain";
}

// A sandbox created from a flattened snapshot checkpoints on it like on any other; a line of sandboxes each
// made from the last one's checkpoint stays within the limit (here 3 above the image), generation after
// generation.
TEST_F(CheckpointerTest, GenerationsOfCreatesFromCheckpointsStayShort) {
  const std::string image_layer = add_base_image(*images_, tmp_.path());
  std::vector<std::string> base = {image_layer};
  for (int generation = 0; generation < 6; ++generation) {
    fs::remove_all(upper_);
    fs::create_directories(upper_);
    fs::remove(tmp_.path() + "/sandbox/checkpoint.index");
    write("gen/" + std::to_string(generation), std::to_string(generation));
    CheckpointJob j = job();
    j.base_layers = base;
    j.max_layers_above_image = 3;
    auto taken = checkpoint(*images_, *snapshots_, j, freezer_);
    ASSERT_TRUE(taken) << "generation " << generation << ": " << taken.message();
    base = taken->snapshot.layers;
    EXPECT_LE(base.size(), 4u) << "generation " << generation;
  }
  // Every generation's file is in the last chain's trees.
  for (int generation = 0; generation < 6; ++generation) {
    bool found = false;
    for (const std::string& layer : base) found = found || fs::exists(tree(layer) + "/gen/" + std::to_string(generation));
    EXPECT_TRUE(found) << "generation " << generation << "'s file is gone";
  }
}

TEST_F(CheckpointerTest, AFailedFreezeLeavesNothing) {
  write("f", "x");
  freezer_.fail_freeze = true;
  auto r = take();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), Error::kTimeout);
  EXPECT_NE(r.message().find("freeze"), std::string::npos);
  EXPECT_TRUE(snapshots_->list()->empty());
  EXPECT_EQ(stored_layers(), 0u);
  EXPECT_FALSE(fs::exists(tmp_.path() + "/sandbox/checkpoint.index"));
}

TEST_F(CheckpointerTest, AFailureAfterTheLayerLeavesNoSnapshotAndTheSandboxThawed) {
  write("f", "x");
  // The record cannot be written: the snapshot directory is gone and a file stands in its place.
  fs::remove_all(snapshots_->root());
  testing::write_file(snapshots_->root(), "");
  auto r = take();
  ASSERT_FALSE(r);
  EXPECT_FALSE(freezer_.frozen);
  EXPECT_EQ(freezer_.thaws, 1);
  EXPECT_FALSE(fs::exists(tmp_.path() + "/sandbox/checkpoint.index")) << "an index for a layer no record names";
  // What the next node start sees: no record, and its GC takes the unnamed layer.
  fs::remove(snapshots_->root());
  auto reopened = SnapshotStore::open(snapshots_->root());
  ASSERT_TRUE(reopened);
  EXPECT_TRUE(reopened->list()->empty());
  ASSERT_TRUE(images_->collect_unused());
  EXPECT_EQ(stored_layers(), 0u);
}

TEST_F(CheckpointerTest, AnUnrepresentableUpperDirFailsWithTheSandboxThawed) {
  write("f", "x");
  ASSERT_EQ(::symlink("f", (upper_ + "/link").c_str()), 0);
  ASSERT_EQ(::lchown((upper_ + "/link").c_str(), 70000, 70000), 0);  // outside the sandbox's id range
  auto r = take();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), Error::kInvalidArgument);
  EXPECT_NE(r.message().find("'/link' is owned by host 70000:70000"), std::string::npos) << r.message();
  EXPECT_FALSE(freezer_.frozen);
  EXPECT_TRUE(snapshots_->list()->empty());
  EXPECT_EQ(stored_layers(), 0u);
}

}  // namespace
}  // namespace sg::snapshot
