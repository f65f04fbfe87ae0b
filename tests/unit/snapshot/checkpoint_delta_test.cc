#include "snapshot/checkpoint_delta.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/xattr.h>

#include <climits>
#include <filesystem>

#include "tests/unit/snapshot/archive_builder.h"
#include "tests/unit/temp_dir.h"

namespace sg::snapshot {
namespace {

namespace fs = std::filesystem;

EntrySig file(uint64_t ino, int64_t ctime = 1) { return EntrySig{ino, ctime, ctime, 10, S_IFREG | 0644, 0, 0, 0, false}; }
EntrySig dir(uint64_t ino, int64_t ctime = 1, bool opaque = false) {
  return EntrySig{ino, ctime, ctime, 4096, S_IFDIR | 0755, 0, 0, 0, opaque};
}

using Paths = std::set<std::string>;
using List = std::vector<std::string>;

TEST(CheckpointDelta, AFirstCheckpointIsTheWholeUpperDir) {
  UpperIndex current = {{"etc", dir(1)}, {"etc/motd", file(2)}, {"root", dir(3)}, {"root/v", file(4)}};
  DeltaPlan plan = plan_delta({}, current);
  EXPECT_EQ(plan.entries, (Paths{"etc", "etc/motd", "root", "root/v"}));
  EXPECT_TRUE(plan.whiteouts.empty());
  EXPECT_TRUE(plan.opaque.empty());
}

TEST(CheckpointDelta, OnlyChangedEntriesAndTheirParentsGoIn) {
  UpperIndex previous = {{"a", dir(1)}, {"a/b", dir(2)}, {"a/b/same", file(3)}, {"a/b/changed", file(4)},
                         {"top", file(5)}};
  UpperIndex current = previous;
  current["a/b/changed"] = file(4, 2);  // written: its ctime moved
  current["a/b/new"] = file(6);
  current["a/b"] = dir(2, 2);  // an entry was added
  DeltaPlan plan = plan_delta(previous, current);
  EXPECT_EQ(plan.entries, (Paths{"a", "a/b", "a/b/changed", "a/b/new"}));
  EXPECT_TRUE(plan.whiteouts.empty());
  // Nothing changed: an empty plan (no layer).
  DeltaPlan none = plan_delta(current, current);
  EXPECT_TRUE(none.entries.empty());
  EXPECT_TRUE(none.whiteouts.empty());
}

TEST(CheckpointDelta, AGonePathGetsOneWhiteoutAtItsTopmostGoneDirectory) {
  UpperIndex previous = {{"work", dir(1)}, {"work/tmp", dir(2)}, {"work/tmp/x", file(3)}, {"work/tmp/y", file(4)},
                         {"work/keep", file(5)}, {"gone", file(6)}};
  UpperIndex current = {{"work", dir(1, 2)}, {"work/keep", file(5)}};
  DeltaPlan plan = plan_delta(previous, current);
  EXPECT_EQ(plan.whiteouts, (List{"gone", "work/tmp"}));
  EXPECT_EQ(plan.entries, (Paths{"work"}));
}

TEST(CheckpointDelta, ADirectoryMadeAgainIsWrittenWholeAndOpaque) {
  // rm -rf cache && mkdir cache && touch cache/new: overlayfs marks the new directory opaque.
  UpperIndex previous = {{"cache", dir(1)}, {"cache/old", file(2)}, {"cache/same-name", file(3)}};
  UpperIndex current = {{"cache", dir(9, 5, true)}, {"cache/same-name", file(3)}, {"cache/new", file(10)}};
  DeltaPlan plan = plan_delta(previous, current);
  EXPECT_EQ(plan.opaque, (Paths{"cache"}));
  EXPECT_EQ(plan.entries, (Paths{"cache", "cache/new", "cache/same-name"}));
  EXPECT_TRUE(plan.whiteouts.empty()) << "the opaque marker hides cache/old already";
  // Still opaque at the next checkpoint: no marker again (the layer below has it), only the change.
  UpperIndex later = current;
  later["cache/new"] = file(10, 6);
  DeltaPlan next = plan_delta(current, later);
  EXPECT_TRUE(next.opaque.empty());
  EXPECT_EQ(next.entries, (Paths{"cache", "cache/new"}));
}

TEST(CheckpointDelta, AFileOverAGoneDirectoryHidesItWithoutWhiteoutsBelow) {
  UpperIndex previous = {{"d", dir(1)}, {"d/x", file(2)}};
  UpperIndex current = {{"d", file(3)}};
  DeltaPlan plan = plan_delta(previous, current);
  EXPECT_EQ(plan.entries, (Paths{"d"}));
  EXPECT_TRUE(plan.whiteouts.empty());
}

TEST(CheckpointDelta, TheIndexRoundTripsAnyPathAndRefusesGarbage) {
  CheckpointIndex index;
  index.chain = {"sha256:" + std::string(64, 'a'), "sha256:" + std::string(64, 'b')};
  index.index = {{"a dir/with\nnewline", dir(1, 123456789012345, true)}, {"x", file(2, -5)}};
  std::string text = encode_index(index);
  auto back = decode_index(text);
  ASSERT_TRUE(back) << back.message();
  EXPECT_EQ(back->chain, index.chain);
  EXPECT_EQ(back->index, index.index);
  EXPECT_TRUE(back->base.empty()) << "an index without a base (as written before flattening) reads as one";
  // A flattened chain's index names the base it was made for.
  CheckpointIndex flattened = index;
  flattened.base = {"sha256:" + std::string(64, 'c')};
  auto with_base = decode_index(encode_index(flattened));
  ASSERT_TRUE(with_base) << with_base.message();
  EXPECT_EQ(with_base->base, flattened.base);
  EXPECT_EQ(with_base->index, index.index);
  for (std::string bad : {std::string(), std::string("garbage"), text.substr(0, text.size() - 1), text + "x",
                          text + "base 2\nsha256:" + std::string(64, 'c') + "\n", text + "base 1\nsha256:short\n",
                          std::string("sandgate-checkpoint-index 1\nchain 1\nsha256:short\nentries 0\n")}) {
    auto got = decode_index(bad);
    EXPECT_FALSE(got) << bad;
    if (!got) {
      EXPECT_EQ(got.error(), Error::kInvalidArgument);
    }
  }
}

TEST(CheckpointDelta, AScanSeesAWriteAsAChangeAndAReadAsNone) {
  testing::TempDir tmp;
  fs::create_directories(tmp.path() + "/up/etc");
  testing::write_file(tmp.path() + "/up/etc/conf", "v1");
  ASSERT_EQ(::setxattr((tmp.path() + "/up/etc").c_str(), "trusted.overlay.opaque", "y", 1, 0), 0);
  auto before = scan_upper(tmp.path() + "/up", 100);
  ASSERT_TRUE(before) << before.message();
  ASSERT_EQ(before->size(), 2u);
  EXPECT_TRUE(before->at("etc").opaque);
  EXPECT_EQ(testing::read_file(tmp.path() + "/up/etc/conf"), "v1");
  auto unchanged = scan_upper(tmp.path() + "/up", 100);
  ASSERT_TRUE(unchanged);
  EXPECT_TRUE(plan_delta(*before, *unchanged).entries.empty());
  // Written again at once, likely within the same tick of the file clock: same size, inode and maybe ctime.
  // Marked racy at the "checkpoint", the entry is taken again anyway.
  UpperIndex recorded = *before;
  mark_racy(recorded, racy_threshold_now());
  testing::write_file(tmp.path() + "/up/etc/conf", "v2");
  auto after = scan_upper(tmp.path() + "/up", 100);
  ASSERT_TRUE(after);
  EXPECT_EQ(plan_delta(recorded, *after).entries, (Paths{"etc", "etc/conf"}));
  // An entry older than the threshold is not racy.
  UpperIndex old = *before;
  mark_racy(old, INT64_MAX);
  EXPECT_EQ(old, *before);
  // The threshold a checkpoint records waits for the clock to pass the newest write: nothing is racy then.
  const int64_t newest = before->at("etc/conf").ctime_ns;
  const int64_t settled = racy_threshold_after(*before, 1'000'000'000);
  EXPECT_GT(settled, newest);
  UpperIndex clean = *before;
  mark_racy(clean, settled);
  EXPECT_EQ(clean, *before);
  // A ctime the clock does not reach (set back since): the wait gives up at its limit, and the entry is racy.
  UpperIndex ahead = *before;
  ahead["etc/conf"].ctime_ns = racy_threshold_now() + 3'600'000'000'000;
  const int64_t gave_up = racy_threshold_after(ahead, 5'000'000);
  EXPECT_LT(gave_up, ahead["etc/conf"].ctime_ns);
  mark_racy(ahead, gave_up);
  EXPECT_NE(ahead["etc/conf"].ctime_ns, before->at("etc/conf").ctime_ns);
  auto limited = scan_upper(tmp.path() + "/up", 1);
  ASSERT_FALSE(limited);
  EXPECT_EQ(limited.error(), Error::kLimitExceeded);
}

}  // namespace
}  // namespace sg::snapshot
