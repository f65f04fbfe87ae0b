// What a live QEMU guest's disk checkpoint copies, from QEMU's answers (noderuntime/disk_delta.h).
#include "noderuntime/disk_delta.h"

#include <gtest/gtest.h>

#include <fstream>

#include "tests/unit/temp_dir.h"

namespace sg {
namespace {

using nlohmann::json;

const std::string kOverlay = "/sb/disk.qcow2";

// query-named-block-nodes (flat) as QEMU 7.2 answers it for a guest whose overlay carries `bitmaps`.
json nodes_with(json bitmaps) {
  return json::array(
      {{{"node-name", "#block0"}, {"drv", "raw"}, {"image", {{"filename", "/disks/base.raw"}}}},
       {{"node-name", "#block1"},
        {"drv", "qcow2"},
        {"image",
         {{"filename", kOverlay},
          {"virtual-size", 1073741824},
          {"backing-filename", "/disks/base.raw"},
          {"full-backing-filename", "/disks/base.raw"},
          {"backing-filename-format", "raw"}}},
        {"dirty-bitmaps", std::move(bitmaps)}},
       {{"node-name", "#block2"}, {"drv", "file"}, {"image", {{"filename", kOverlay}}}}});
}

json bitmap(const std::string& name, bool inconsistent = false) {
  json b = {{"name", name}, {"recording", true}, {"persistent", true}, {"busy", false}, {"granularity", 65536}};
  if (inconsistent) b["inconsistent"] = true;
  return b;
}

class DiskDeltaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_disk_ = dir_.path() + "/snap-aaaaaaaaaaaa.d/disk.qcow2";
    std::filesystem::create_directories(dir_.path() + "/snap-aaaaaaaaaaaa.d");
    std::ofstream(base_disk_) << "qcow2";
  }
  testing::TempDir dir_{"disk-delta"};
  std::string base_disk_;
};

TEST_F(DiskDeltaTest, AFirstCheckpointCopiesTheOverlayOntoItsOwnBackingFile) {
  auto plan = plan_disk_delta(nodes_with(json::array()), kOverlay, std::nullopt, 32);
  ASSERT_TRUE(plan) << plan.message();
  EXPECT_FALSE(plan->delta());
  EXPECT_EQ(plan->backing, "/disks/base.raw");
  EXPECT_EQ(plan->backing_format, "raw");
  EXPECT_EQ(plan->virtual_size, 1073741824u);
  json t = disk_delta_transaction(*plan, "snap-bbbbbbbbbbbb");
  ASSERT_EQ(t["actions"].size(), 2u);
  EXPECT_EQ(t["actions"][0]["type"], "block-dirty-bitmap-add");
  EXPECT_EQ(t["actions"][0]["data"]["name"], "snap-bbbbbbbbbbbb");
  EXPECT_EQ(t["actions"][0]["data"]["persistent"], true);
  EXPECT_EQ(t["actions"][1]["type"], "blockdev-backup");
  EXPECT_EQ(t["actions"][1]["data"]["sync"], "top");
  EXPECT_EQ(t["actions"][1]["data"]["target"], kCheckpointNode);
  EXPECT_EQ(t["actions"][1]["data"]["auto-dismiss"], false);
  EXPECT_FALSE(t["actions"][1]["data"].contains("bitmap"));
}

TEST_F(DiskDeltaTest, ALaterOneCopiesWhatTheLastOnesBitmapMarksOverItsDisk) {
  LastDiskCheckpoint last{"snap-aaaaaaaaaaaa", base_disk_};
  auto plan = plan_disk_delta(nodes_with(json::array({bitmap("snap-aaaaaaaaaaaa"), bitmap("backup-tool")})), kOverlay, last, 32);
  ASSERT_TRUE(plan) << plan.message();
  EXPECT_TRUE(plan->delta());
  EXPECT_EQ(plan->base_id, "snap-aaaaaaaaaaaa");
  EXPECT_EQ(plan->backing, base_disk_);
  EXPECT_EQ(plan->backing_format, "qcow2");
  EXPECT_EQ(plan->chain, 2u);
  EXPECT_TRUE(plan->stale_bitmaps.empty()) << "a bitmap that is not ours was taken for stale";
  json backup = disk_delta_transaction(*plan, "snap-bbbbbbbbbbbb")["actions"][1]["data"];
  EXPECT_EQ(backup["sync"], "bitmap");
  EXPECT_EQ(backup["bitmap"], "snap-aaaaaaaaaaaa");
  EXPECT_EQ(backup["bitmap-mode"], "never");
}

// Never a delta over something that is not there or a bitmap that missed writes: the whole overlay instead,
// and our bitmaps nothing will start from are named for removal.
TEST_F(DiskDeltaTest, WithoutItsDiskItsBitmapOrAConsistentBitmapTheWholeOverlayIsCopied) {
  LastDiskCheckpoint last{"snap-aaaaaaaaaaaa", base_disk_};
  auto inconsistent = plan_disk_delta(nodes_with(json::array({bitmap("snap-aaaaaaaaaaaa", true)})), kOverlay, last, 32);
  ASSERT_TRUE(inconsistent);
  EXPECT_FALSE(inconsistent->delta());
  EXPECT_EQ(inconsistent->backing, "/disks/base.raw");
  EXPECT_EQ(inconsistent->stale_bitmaps, std::vector<std::string>{"snap-aaaaaaaaaaaa"});

  auto no_bitmap = plan_disk_delta(nodes_with(json::array({bitmap("snap-cccccccccccc")})), kOverlay, last, 32);
  ASSERT_TRUE(no_bitmap);
  EXPECT_FALSE(no_bitmap->delta());
  EXPECT_EQ(no_bitmap->stale_bitmaps, std::vector<std::string>{"snap-cccccccccccc"});

  std::filesystem::remove(base_disk_);
  auto no_disk = plan_disk_delta(nodes_with(json::array({bitmap("snap-aaaaaaaaaaaa")})), kOverlay, last, 32);
  ASSERT_TRUE(no_disk);
  EXPECT_FALSE(no_disk->delta());
  EXPECT_EQ(no_disk->stale_bitmaps, std::vector<std::string>{"snap-aaaaaaaaaaaa"});
}

// A chain of deltas as long as the node allows: the next checkpoint is whole, and starts a new chain.
TEST_F(DiskDeltaTest, AFullChainStartsOverWithTheWholeOverlay) {
  auto nodes = nodes_with(json::array({bitmap("snap-aaaaaaaaaaaa")}));
  auto last_but_one = plan_disk_delta(nodes, kOverlay, LastDiskCheckpoint{"snap-aaaaaaaaaaaa", base_disk_, 31}, 32);
  ASSERT_TRUE(last_but_one);
  EXPECT_TRUE(last_but_one->delta());
  EXPECT_EQ(last_but_one->chain, 32u);
  auto full = plan_disk_delta(nodes, kOverlay, LastDiskCheckpoint{"snap-aaaaaaaaaaaa", base_disk_, 32}, 32);
  ASSERT_TRUE(full);
  EXPECT_FALSE(full->delta());
  EXPECT_EQ(full->chain, 1u);
  EXPECT_EQ(full->backing, "/disks/base.raw");
  EXPECT_EQ(full->stale_bitmaps, std::vector<std::string>{"snap-aaaaaaaaaaaa"});
}

// A sandbox made from a snapshot of a sandbox made from a snapshot...: once the disks under its overlay reach
// the bound, its next whole copy first streams them into the overlay, and the new disk backs on the bottom.
TEST_F(DiskDeltaTest, AnInheritedChainAtTheBoundIsStreamedIntoTheOverlayFirst) {
  auto node = [](const std::string& name, const std::string& drv, const std::string& file, const std::string& backing,
                 const std::string& format) {
    json image = {{"filename", file}, {"virtual-size", 1073741824}};
    if (!backing.empty()) {
      image["backing-filename"] = backing;
      image["full-backing-filename"] = backing;
      image["backing-filename-format"] = format;
    }
    return json{{"node-name", name}, {"drv", drv}, {"image", image}};
  };
  // overlay -> s2 -> s1 -> base.raw, each with its file node.
  json nodes = json::array({node("#ov", "qcow2", kOverlay, "/snaps/s2.qcow2", "qcow2"),
                            node("#ovf", "file", kOverlay, "", ""),
                            node("#s2", "qcow2", "/snaps/s2.qcow2", "/snaps/s1.qcow2", "qcow2"),
                            node("#s2f", "file", "/snaps/s2.qcow2", "", ""),
                            node("#s1", "qcow2", "/snaps/s1.qcow2", "/disks/base.raw", "raw"),
                            node("#s1f", "file", "/snaps/s1.qcow2", "", ""),
                            node("#base", "raw", "/disks/base.raw", "", ""),
                            node("#basef", "file", "/disks/base.raw", "", "")});
  auto under_bound = plan_disk_delta(nodes, kOverlay, std::nullopt, 3);
  ASSERT_TRUE(under_bound) << under_bound.message();
  EXPECT_EQ(under_bound->stream_base_node, "");
  EXPECT_EQ(under_bound->backing, "/snaps/s2.qcow2");
  auto at_bound = plan_disk_delta(nodes, kOverlay, std::nullopt, 2);
  ASSERT_TRUE(at_bound) << at_bound.message();
  EXPECT_EQ(at_bound->stream_base_node, "#base");
  EXPECT_EQ(at_bound->backing, "/disks/base.raw");
  EXPECT_EQ(at_bound->backing_format, "raw");
  json stream = disk_stream_arguments(*at_bound);
  EXPECT_EQ(stream["base-node"], "#base");
  EXPECT_EQ(stream["device"], "root");
  EXPECT_EQ(stream["job-id"], kCheckpointNode);
  // A loop of backing files (a damaged chain) ends the walk rather than the node.
  json loop = json::array({node("#ov", "qcow2", kOverlay, "/snaps/a.qcow2", "qcow2"),
                           node("#a", "qcow2", "/snaps/a.qcow2", "/snaps/b.qcow2", "qcow2"),
                           node("#b", "qcow2", "/snaps/b.qcow2", "/snaps/a.qcow2", "qcow2")});
  EXPECT_TRUE(plan_disk_delta(loop, kOverlay, std::nullopt, 2));
}

// QEMU's answers are the peer's: anything malformed is an error naming what is missing, never a crash.
TEST_F(DiskDeltaTest, AMalformedAnswerIsAnErrorNotACrash) {
  for (const json& bad : {json(nullptr), json("nodes"), json::array(), json::array({42, "x", nullptr}),
                          json::array({{{"drv", 7}, {"image", "x"}}}),
                          json::array({{{"drv", "qcow2"}, {"image", {{"filename", kOverlay}, {"virtual-size", "big"}}}}}),
                          json::array({{{"drv", "qcow2"}, {"image", {{"filename", kOverlay}, {"virtual-size", 65536}}}}}),
                          json::array({{{"drv", "qcow2"},
                                        {"image", {{"filename", kOverlay}, {"virtual-size", 65536},
                                                   {"backing-filename", "/b"}, {"backing-filename-format", "vmdk"}}}}})}) {
    auto plan = plan_disk_delta(bad, kOverlay, std::nullopt, 32);
    EXPECT_FALSE(plan) << bad.dump();
    if (!plan) {
      EXPECT_NE(plan.message().find(kOverlay), std::string::npos) << plan.message();
    }
  }
  json odd = nodes_with(json::array({42, "x", {{"name", 7}}, {{"name", "snap-aaaaaaaaaaaa"}, {"inconsistent", "yes"}}}));
  auto plan = plan_disk_delta(odd, kOverlay, LastDiskCheckpoint{"snap-aaaaaaaaaaaa", base_disk_}, 32);
  ASSERT_TRUE(plan) << plan.message();
  EXPECT_TRUE(plan->delta()) << "an 'inconsistent' that is not true made the bitmap unusable";
}

TEST_F(DiskDeltaTest, TheBackupJobIsFollowedByItsStatusAndItsErrorIsTheFailure) {
  auto job = [](json fields) {
    fields["id"] = kCheckpointNode;
    fields["type"] = "backup";
    return json::array({{{"id", "other"}, {"status", "concluded"}, {"error", "not ours"}}, std::move(fields)});
  };
  EXPECT_EQ(*backup_job_state(job({{"status", "running"}})), BackupJob::kRunning);
  EXPECT_EQ(*backup_job_state(job({{"status", "pending"}})), BackupJob::kRunning);
  EXPECT_EQ(*backup_job_state(job({{"status", "concluded"}})), BackupJob::kConcluded);
  auto failed = backup_job_state(job({{"status", "concluded"}, {"error", "No space left on device"}}));
  ASSERT_FALSE(failed);
  EXPECT_NE(failed.message().find("No space left on device"), std::string::npos);
  EXPECT_EQ(*backup_job_state(json::array()), BackupJob::kAbsent);
  EXPECT_FALSE(backup_job_state(json::object()));
}

TEST_F(DiskDeltaTest, TheLastCheckpointRoundTripsAndADamagedMarkerIsNone) {
  EXPECT_FALSE(read_last_disk_checkpoint(dir_.path()).has_value());
  ASSERT_TRUE(write_last_disk_checkpoint(dir_.path(), {"snap-aaaaaaaaaaaa", base_disk_, 7}));
  auto last = read_last_disk_checkpoint(dir_.path());
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->id, "snap-aaaaaaaaaaaa");
  EXPECT_EQ(last->disk, base_disk_);
  EXPECT_EQ(last->chain, 7u);
  for (const char* damaged : {"snap-aaaaaaaaaaaa\n", "../etc\n/x\n1\n", "snap-aaaaaaaaaaaa\nrelative/disk\n1\n", "",
                              "snap-aaaaaaaaaaaa\n/x\n", "snap-aaaaaaaaaaaa\n/x\n0\n", "snap-aaaaaaaaaaaa\n/x\n2x\n",
                              "snap-aaaaaaaaaaaa\n/x\n99999999999\n"}) {
    std::ofstream(dir_.path() + "/" + kDiskCheckpointMarker, std::ios::trunc) << damaged;
    EXPECT_FALSE(read_last_disk_checkpoint(dir_.path()).has_value()) << damaged;
  }
}

}  // namespace
}  // namespace sg
