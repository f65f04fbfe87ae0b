#include "snapshot/layer_squash.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <filesystem>

#include "tests/unit/snapshot/archive_builder.h"
#include "tests/unit/temp_dir.h"

namespace sg::snapshot {
namespace {

namespace fs = std::filesystem;

class LayerSquashTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto images = ImageStore::open(tmp_.path() + "/store");
    ASSERT_TRUE(images) << images.message();
    images_ = std::move(*images);
  }
  // A layer of `entries` in the store, pinned (and so kept) until the test ends.
  std::string layer(const std::vector<testing::Entry>& entries) {
    const std::string blob = tmp_.path() + "/layer" + std::to_string(++layers_) + ".tar";
    EXPECT_TRUE(testing::write_tar(blob, entries));
    auto digest = sha256_file(blob);
    auto added = images_->add_pinned_layer(blob, *digest, "a test layer");
    EXPECT_TRUE(added) << added.message();
    return *added;
  }
  std::string tree(const std::string& digest) const { return images_->layers().tree_path(digest); }

  testing::TempDir tmp_;
  std::unique_ptr<ImageStore> images_;
  int layers_ = 0;
};

// What overlayfs would show of the stack, as one layer: a file over a directory and a directory over a file
// replace what was there, whiteouts stay whiteouts, hard links inside a layer stay links, and the layers
// themselves are untouched.
TEST_F(LayerSquashTest, TheStackBecomesOneLayerShowingTheSameTree) {
  const std::string bottom = layer({testing::dir("was-dir"), testing::file("was-dir/inner", "x"),
                                    testing::file("was-file", "y"), testing::file("kept", "bottom"),
                                    testing::file("replaced", "old"), testing::file("linked", "shared"),
                                    testing::hardlink("linked-too", "linked")});
  const std::string top = layer({testing::file("was-dir", "now a file"), testing::dir("was-file"),
                                 testing::file("was-file/child", "z"), testing::file("replaced", "new"),
                                 testing::file(".wh.gone", "")});
  auto squashed = squash_layers(*images_, {bottom, top}, "the test stack");
  ASSERT_TRUE(squashed) << squashed.message();
  ASSERT_FALSE(squashed->empty());
  const std::string merged = tree(*squashed);
  EXPECT_EQ(testing::read_file(merged + "/was-dir"), "now a file");
  EXPECT_FALSE(fs::exists(merged + "/was-dir/inner"));
  EXPECT_EQ(testing::read_file(merged + "/was-file/child"), "z");
  EXPECT_EQ(testing::read_file(merged + "/kept"), "bottom");
  EXPECT_EQ(testing::read_file(merged + "/replaced"), "new");
  struct stat a{}, b{}, w{};
  ASSERT_EQ(::lstat((merged + "/linked").c_str(), &a), 0);
  ASSERT_EQ(::lstat((merged + "/linked-too").c_str(), &b), 0);
  EXPECT_EQ(a.st_ino, b.st_ino) << "a hard link inside a layer became two files";
  ASSERT_EQ(::lstat((merged + "/gone").c_str(), &w), 0);
  EXPECT_TRUE(S_ISCHR(w.st_mode));
  EXPECT_EQ(w.st_rdev, makedev(0, 0));
  // The layers are as they were, and nothing of the scratch tree is left.
  EXPECT_EQ(testing::read_file(tree(bottom) + "/replaced"), "old");
  EXPECT_TRUE(fs::is_directory(tree(bottom) + "/was-dir"));
  for (const auto& e : fs::directory_iterator(images_->layers().root() + "/tmp")) ADD_FAILURE() << "left " << e.path();
  // The same stack gives the same layer.
  auto again = squash_layers(*images_, {bottom, top}, "the test stack");
  ASSERT_TRUE(again) << again.message();
  EXPECT_EQ(*again, *squashed);
}

TEST_F(LayerSquashTest, AnEmptyStackIsNoLayer) {
  auto squashed = squash_layers(*images_, {}, "nothing");
  ASSERT_TRUE(squashed) << squashed.message();
  EXPECT_EQ(*squashed, "");
}

}  // namespace
}  // namespace sg::snapshot
