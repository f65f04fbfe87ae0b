// Filesystem checkpoints of process sandboxes (docs/snapshots.md), through the CLI and the node API as a user
// would: checkpoint a running sandbox, create sandboxes from its snapshots, remove them, restart the node.
// Each cluster has an image store of its own (so the layer store's bytes can be compared with a baseline),
// into which the shared test image is imported once.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <iostream>
#include <set>
#include <vector>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

ClusterOptions own_store_with_proxy() {
  ClusterOptions o;
  o.node_extra = "images_dir = \"\"\ndefault_image = \"test\"\n";
  return o;
}

void import_test_image(Cluster& c) {
  auto imported = c.cli("image import " + shell_quote(test_image().archive) + " test", 300);
  ASSERT_EQ(imported.exit_code, 0) << imported.out << imported.err;
}

std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

// The layer store as the node keeps it: each layer's directory name and the bytes of everything in it.
std::set<std::string> stored_layers(Cluster& c) {
  std::set<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(c.dir() + "/node/layers/sha256", ec)) out.insert(e.path().filename());
  return out;
}
uint64_t store_bytes(Cluster& c) {
  auto r = run("du -sb " + shell_quote(c.dir() + "/node/layers/sha256") + " | cut -f1");
  return std::stoull(r.out.empty() ? "0" : r.out);
}

json checkpoint(Cluster& c, const std::string& name) {
  auto r = c.cli("checkpoint --json " + name);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  json j = json::parse(r.out, nullptr, false);
  EXPECT_TRUE(j.is_object() && j.contains("snapshot_id")) << r.out;
  return j.is_object() ? j : json::object();
}

std::string token_of(const json& created) { return created.value("token", ""); }

TEST(Snapshot, CheckpointCreateFromRestartAndRemove) {
  Cluster c(own_store_with_proxy());
  import_test_image(c);
  const std::set<std::string> baseline_layers = stored_layers(c);
  const uint64_t baseline_bytes = store_bytes(c);

  json src = create_with_agent(c, "src", "-- /bin/sleep 3600");
  const std::string src_token = token_of(src);
  ASSERT_FALSE(src_token.empty());
  ASSERT_EQ(sh(c, "src", src_token, "echo v1 > /root/file && echo bye > /root/doomed").code, 0);

  // The plain form prints the id alone.
  auto first = c.cli("checkpoint src");
  ASSERT_EQ(first.exit_code, 0) << first.err;
  const std::string snap1 = trimmed(first.out);
  ASSERT_EQ(snap1.rfind("snap-", 0), 0u) << first.out;
  ASSERT_EQ(sh(c, "src", src_token, "echo v2 > /root/file && rm /root/doomed").code, 0);
  const std::string snap2 = checkpoint(c, "src").value("snapshot_id", "");
  ASSERT_FALSE(snap2.empty());

  // The source kept running with its id and token, and reads what it wrote last.
  json after = c.get("src");
  EXPECT_EQ(after["id"], src["id"]);
  EXPECT_EQ(after["state"], "running");
  Exec src_reads = sh(c, "src", src_token, "cat /root/file");
  EXPECT_EQ(src_reads.code, 0);
  EXPECT_EQ(src_reads.out, "v2\n");

  // From the first snapshot (no command given: the source's): v1, and the file deleted later is there.
  json one = create_with_agent(c, "one", "--from " + snap1);
  ASSERT_FALSE(token_of(one).empty());
  EXPECT_NE(one["id"], src["id"]);
  EXPECT_NE(token_of(one), src_token);
  Exec one_reads = sh(c, "one", token_of(one), "cat /root/file /root/doomed");
  EXPECT_EQ(one_reads.out, "v1\nbye\n");
  // From the second: v2, and the deleted file is absent. Resources may differ from the source's.
  json two = create_with_agent(c, "two", "--from " + snap2 + " --memory-mb 256 --cpus 0.5");
  EXPECT_EQ(two["memory_mb"], 256);
  Exec two_reads = sh(c, "two", token_of(two), "cat /root/file; test -e /root/doomed && echo present || echo absent");
  EXPECT_EQ(two_reads.out, "v2\nabsent\n");
  // Writes in a sandbox made from a snapshot stay its own.
  ASSERT_EQ(sh(c, "two", token_of(two), "echo mine > /root/file").code, 0);
  EXPECT_EQ(sh(c, "one", token_of(one), "cat /root/file").out, "v1\n");
  EXPECT_EQ(sh(c, "src", src_token, "cat /root/file").out, "v2\n");
  // A sandbox made from a snapshot can be checkpointed in turn: its chain continues on the snapshot's.
  const std::string snap3 = checkpoint(c, "two").value("snapshot_id", "");
  ASSERT_FALSE(snap3.empty());
  json three = create_with_agent(c, "three", "--from " + snap3);
  EXPECT_EQ(sh(c, "three", token_of(three), "cat /root/file; test -e /root/doomed || echo absent").out, "mine\nabsent\n");

  // A memory checkpoint on the process driver is a clear 400, never a silent filesystem one.
  auto memory = c.api_raw("POST", "/v1/sandboxes/src/checkpoint", "{\"type\": \"memory\"}");
  EXPECT_EQ(memory.out.substr(memory.out.rfind('\n') + 1), "400") << memory.out;
  EXPECT_NE(memory.out.find("\"error\":\"unsupported\""), std::string::npos) << memory.out;
  auto memory_cli = c.cli("checkpoint src --type memory");
  EXPECT_EQ(memory_cli.exit_code, 1);
  EXPECT_NE(memory_cli.err.find("memory checkpoints are not supported by the process driver"), std::string::npos)
      << memory_cli.err;

  // A suspended sandbox is checkpointed as it is (its frozen files), and stays suspended.
  ASSERT_EQ(c.cli("suspend src").exit_code, 0);
  ASSERT_TRUE(eventually([&] { return c.get("src").value("state", "") == "suspended"; }, std::chrono::seconds(10)));
  auto asleep = c.cli("checkpoint src");
  ASSERT_EQ(asleep.exit_code, 0) << asleep.err;
  const std::string snap_asleep = trimmed(asleep.out);
  EXPECT_EQ(c.get("src").value("state", ""), "suspended");
  EXPECT_EQ(c.get("src").value("tier", ""), "memory");
  json from_asleep = create_with_agent(c, "asleep", "--from " + snap_asleep);
  EXPECT_EQ(sh(c, "asleep", token_of(from_asleep), "cat /root/file").out, "v2\n");
  ASSERT_EQ(c.cli("rm asleep").exit_code, 0);
  ASSERT_EQ(c.cli("snapshot rm " + snap_asleep).exit_code, 0);

  // In use: snapshot rm is refused naming the sandbox, image rm naming a user.
  auto refused = c.cli("snapshot rm " + snap1);
  EXPECT_EQ(refused.exit_code, 1);
  EXPECT_NE(refused.err.find("in use by sandbox one"), std::string::npos) << refused.err;
  auto image_refused = c.cli("image rm test");
  EXPECT_EQ(image_refused.exit_code, 1);
  EXPECT_NE(image_refused.err.find("in use by"), std::string::npos) << image_refused.err;

  // A node killed and started again lists the snapshots and adopts the sandboxes made from them; those
  // survive a suspend and resume too.
  c.stop_node(SIGKILL);
  c.start_node();
  auto listed = c.cli("snapshots --json");
  ASSERT_EQ(listed.exit_code, 0) << listed.err;
  json snaps = json::parse(listed.out, nullptr, false);
  ASSERT_TRUE(snaps.is_object()) << listed.out;
  std::set<std::string> ids;
  for (const json& s : snaps["snapshots"]) ids.insert(s.value("id", ""));
  EXPECT_EQ(ids, (std::set<std::string>{snap1, snap2, snap3}));
  EXPECT_EQ(snaps["snapshots"][1]["layers"].size(), 3u) << "image layer + two checkpoint layers";
  EXPECT_EQ(snaps["snapshots"][2]["layers"].size(), 4u) << "snap2's layers + the one two added";
  auto table = c.cli("snapshots");
  EXPECT_EQ(table.out.rfind("ID", 0), 0u) << table.out;
  std::string row = table.out.substr(table.out.find(snap1));
  row = row.substr(0, row.find('\n'));
  EXPECT_NE(row.find(" src "), std::string::npos) << table.out;
  EXPECT_NE(row.find(" filesystem "), std::string::npos) << table.out;
  EXPECT_EQ(sh(c, "one", token_of(one), "cat /root/file").out, "v1\n");
  ASSERT_EQ(c.cli("suspend one").exit_code, 0);
  ASSERT_TRUE(eventually([&] { return c.get("one").value("state", "") == "suspended"; }, std::chrono::seconds(10)));
  EXPECT_EQ(sh(c, "one", token_of(one), "cat /root/file").out, "v1\n") << "woken by the exec";

  // A checkpoint layer whose bytes no longer match its digest is refused, naming it.
  const std::string layer2 = snaps["snapshots"][1]["layer"].get<std::string>();
  run("printf x >> " + shell_quote(c.dir() + "/node/layers/sha256/" + layer2.substr(7) + "/blob"));
  auto corrupted = c.cli("create --from " + snap2);
  EXPECT_EQ(corrupted.exit_code, 1);
  EXPECT_NE(corrupted.err.find("layer " + layer2 + " is corrupted"), std::string::npos) << corrupted.err;

  // Once no sandbox uses them, the snapshots go, and with them every byte they added to the store.
  for (const char* name : {"one", "two", "three", "src"}) ASSERT_EQ(c.cli(std::string("rm ") + name).exit_code, 0);
  // No sandbox uses the image now, but the snapshots stack on it.
  auto image_held = c.cli("image rm test");
  EXPECT_EQ(image_held.exit_code, 1);
  EXPECT_NE(image_held.err.find("in use by snapshot snap-"), std::string::npos) << image_held.err;
  auto removed = c.cli("snapshot rm " + snap1);
  EXPECT_EQ(removed.exit_code, 0) << removed.err;
  EXPECT_EQ(removed.out, "removed snapshot " + snap1 + "\n");
  EXPECT_NE(stored_layers(c), baseline_layers) << "snap2 stacks on snap1's layer, which must stay";
  ASSERT_EQ(c.cli("snapshot rm " + snap3).exit_code, 0);
  ASSERT_EQ(c.cli("snapshot rm " + snap2).exit_code, 0);
  EXPECT_EQ(stored_layers(c), baseline_layers);
  EXPECT_EQ(store_bytes(c), baseline_bytes);
  EXPECT_EQ(c.cli("snapshots").out, "ID  SOURCE  TYPE  LAYERS  LAYER-SIZE  AGE\n");
  auto gone = c.cli("create --from " + snap1 + " -- /bin/true");
  EXPECT_EQ(gone.exit_code, 1);
  EXPECT_NE(gone.err.find("no snapshot " + snap1), std::string::npos) << gone.err;
  auto bad = c.api_raw("GET", "/v1/snapshots/..%2Fetc", "");
  EXPECT_EQ(bad.out.substr(bad.out.rfind('\n') + 1), "400") << bad.out;
}

// Crash safety: the node dies (kill -9) while a checkpoint holds the sandbox frozen.
// A session checkpointed again and again: once its chain holds node.checkpoint_flatten_layers (here 4) layers
// above the image's, the next checkpoint flattens them into one first (snapshot/layer_squash.h), so the chain
// never reaches overlayfs' limit. What every checkpoint wrote, and an image file deleted at the start, are as
// they were in a sandbox created from the last snapshot; the earlier snapshots keep their own chains.
// A sandbox with disk_mb keeps its upper dir on an ext4 file mounted in its own namespace only: the node reads
// it through the same loop device, and its checkpoints are what any sandbox's are (v1 in the snapshot, v2 in
// the source, the next checkpoint only what changed). Its size limit holds in a sandbox made from it too.
TEST(Snapshot, ASandboxWithADiskLimitIsCheckpointedLikeAnyOther) {
  Cluster c(own_store_with_proxy());
  import_test_image(c);
  json src = create_with_agent(c, "lim", "--disk-mb 64 -- /bin/sleep 3600");
  const std::string token = token_of(src);
  ASSERT_FALSE(token.empty());
  ASSERT_EQ(sh(c, "lim", token, "echo v1 > /root/file && head -c 4194304 /dev/urandom > /root/blob && "
                                "sha256sum /root/blob").code, 0);
  const std::string blob = sh(c, "lim", token, "sha256sum < /root/blob").out;
  json first = checkpoint(c, "lim");
  const std::string snap1 = first.value("snapshot_id", "");
  ASSERT_FALSE(snap1.empty());
  EXPECT_GT(first["snapshot"].value("layer_bytes", 0ull), 4ull << 20) << first.dump();
  ASSERT_EQ(sh(c, "lim", token, "echo v2 > /root/file").code, 0);
  json second = checkpoint(c, "lim");
  EXPECT_LT(second["snapshot"].value("layer_bytes", 0ull), 64ull << 10) << "the second checkpoint took more than "
                                                                        << "what changed: " << second.dump();
  EXPECT_EQ(c.get("lim").value("state", ""), "running");
  EXPECT_EQ(sh(c, "lim", token, "cat /root/file").out, "v2\n");
  // No mount of the sandbox's disk is left in the node's namespace.
  EXPECT_EQ(run("grep -c " + shell_quote(src.value("id", "")) + " /proc/self/mountinfo").out, "0\n");

  json copy = create_with_agent(c, "lim-copy", "--from " + snap1 + " --disk-mb 64");
  const std::string copy_token = token_of(copy);
  ASSERT_FALSE(copy_token.empty());
  EXPECT_EQ(sh(c, "lim-copy", copy_token, "cat /root/file").out, "v1\n");
  EXPECT_EQ(sh(c, "lim-copy", copy_token, "sha256sum < /root/blob").out, blob);
  Exec dd = sh(c, "lim-copy", copy_token, "dd if=/dev/zero of=/root/fill bs=1M count=96 2>&1; echo dd=$?");
  EXPECT_NE(dd.out.find("No space left on device"), std::string::npos) << dd.out;
}

TEST(Snapshot, ALongSessionsChainIsFlattenedAndStillHoldsEverything) {
  ClusterOptions options = own_store_with_proxy();
  options.node_extra += "checkpoint_flatten_layers = 4\n";
  Cluster c(options);
  import_test_image(c);
  json src = create_with_agent(c, "long", "-- /bin/sleep 3600");
  const std::string token = token_of(src);
  ASSERT_FALSE(token.empty());
  ASSERT_EQ(sh(c, "long", token, "rm /etc/hostname && mkdir -p /root/steps").code, 0);
  size_t image_layers = 0;
  json last, first_snapshot;
  std::vector<double> ms;
  for (int step = 1; step <= 6; ++step) {
    ASSERT_EQ(sh(c, "long", token, "echo " + std::to_string(step) + " > /root/steps/" + std::to_string(step)).code, 0);
    const auto started = std::chrono::steady_clock::now();
    last = checkpoint(c, "long");
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count());
    ASSERT_TRUE(last.contains("snapshot")) << "step " << step;
    const size_t layers = last["snapshot"]["layers"].size();
    if (step == 1) {
      image_layers = layers - 1;
      first_snapshot = last;
    }
    if (step <= 4) {
      EXPECT_EQ(layers, image_layers + static_cast<size_t>(step)) << "step " << step;
      EXPECT_EQ(last.value("flattened_layers", -1), 0) << "step " << step;
    } else if (step == 5) {
      EXPECT_EQ(last.value("flattened_layers", -1), 4);
      EXPECT_EQ(layers, image_layers + 2) << "the image's, the flattened one, this checkpoint's";
    } else {
      EXPECT_EQ(last.value("flattened_layers", -1), 0);
      EXPECT_EQ(layers, image_layers + 3) << "the next checkpoint stacks on the flattened chain";
      EXPECT_LT(last["snapshot"].value("layer_bytes", 0), 64 * 1024) << "not a delta after the flattening";
    }
  }
  std::fprintf(stderr, "checkpoint CLI round trips: step 4 %.0f ms, step 5 (flattening 4 layers) %.0f ms, step 6 %.0f ms\n",
               ms[3], ms[4], ms[5]);
  const std::string snap = last.value("snapshot_id", "");
  json copy = create_with_agent(c, "copy", "--from " + snap);
  Exec reads = sh(c, "copy", token_of(copy),
                  "cat /root/steps/1 /root/steps/4 /root/steps/5 /root/steps/6; ls /root/steps | wc -l; "
                  "test -e /etc/hostname && echo hostname-back || echo hostname-gone");
  EXPECT_EQ(reads.out, "1\n4\n5\n6\n6\nhostname-gone\n");
  // The first snapshot still reads as it was.
  json early = create_with_agent(c, "early", "--from " + first_snapshot.value("snapshot_id", ""));
  EXPECT_EQ(sh(c, "early", token_of(early), "ls /root/steps").out, "1\n");
  ASSERT_EQ(c.cli("rm copy").exit_code, 0);
  ASSERT_EQ(c.cli("rm early").exit_code, 0);
  ASSERT_EQ(c.cli("rm long").exit_code, 0);
}

TEST(Snapshot, ANodeKilledDuringACheckpointLeavesNoSnapshotAndTheSourceIntact) {
  Cluster c(own_store_with_proxy());
  import_test_image(c);
  const std::set<std::string> baseline = stored_layers(c);
  json src = create_with_agent(c, "src", "-- /bin/sleep 3600");
  const std::string token = token_of(src);
  const std::string id = src.value("id", "");
  // Enough bytes that copying them keeps the sandbox frozen for a good part of a second.
  ASSERT_EQ(sh(c, "src", token, "head -c 256M /dev/zero > /root/big && echo v1 > /root/file").code, 0);
  run(c.sandgate() + " --api " + shell_quote(c.api()) + " checkpoint src < /dev/null > " +
      shell_quote(c.dir() + "/checkpoint.out") + " 2>&1 &");
  ASSERT_TRUE(eventually([&] { return c.cgroup_frozen(id); }, std::chrono::seconds(30)))
      << "the checkpoint never froze the sandbox";
  c.stop_node(SIGKILL);
  c.start_node();

  // No half snapshot is listed, and the store holds what it held before (the work dir is emptied at start).
  EXPECT_EQ(c.cli("snapshots").out, "ID  SOURCE  TYPE  LAYERS  LAYER-SIZE  AGE\n");
  EXPECT_EQ(stored_layers(c), baseline);
  EXPECT_TRUE(fs::is_empty(c.dir() + "/node/layers/tmp"));
  // It was frozen when the node died: the restarted node thaws it and it runs on, its files intact.
  EXPECT_TRUE(eventually([&] { return c.get("src").value("state", "") == "running"; }, std::chrono::seconds(10)))
      << c.get("src").dump();
  EXPECT_FALSE(c.cgroup_frozen(id));
  EXPECT_EQ(sh(c, "src", token, "cat /root/file").out, "v1\n");
  EXPECT_EQ(c.get("src").value("id", ""), id);
  // And a checkpoint now succeeds: a full one (the interrupted one left no index).
  json again = checkpoint(c, "src");
  EXPECT_GT(again["snapshot"].value("layer_bytes", uint64_t{0}), uint64_t{256} << 20);
}

// The layer store's disk fills up during a checkpoint: a clear error, no snapshot, nothing left in the store,
// and the source runs on with its files (thawed); once there is room again, a checkpoint works.
TEST(Snapshot, ADiskFullDuringACheckpointIsAClearErrorAndTheSourceRunsOn) {
  ClusterOptions o = own_store_with_proxy();
  o.node_extra += "store_free_space_reserve_mb = 0\n";  // the disk itself runs out, not the reserve
  Cluster c(o);
  // The layer store on a tmpfs of its own, made before the node opens it (its directories are made at start).
  c.stop_node(SIGTERM);
  const std::string layers = c.dir() + "/node/layers";
  ASSERT_EQ(run("rm -rf " + shell_quote(layers) + " && mkdir -p " + shell_quote(layers) +
                " && mount -t tmpfs -o size=640m sgtest-full " + shell_quote(layers)).exit_code, 0);
  struct Unmount {
    std::string path;
    ~Unmount() { run("umount -l " + shell_quote(path)); }
  } unmount{layers};
  c.start_node();
  import_test_image(c);
  const std::set<std::string> baseline = stored_layers(c);
  auto free_mib = run("df -m --output=avail " + shell_quote(layers) + " | tail -1");
  const long room = std::stol(free_mib.out);
  ASSERT_GT(room, 8) << "the test image left no room on the 640 MiB tmpfs";

  json src = create_with_agent(c, "src", "-- /bin/sleep 3600");
  const std::string token = token_of(src);
  const std::string id = src.value("id", "");
  // More than the store has room for, in a file the checkpoint must copy whole.
  ASSERT_EQ(sh(c, "src", token, "head -c " + std::to_string(room + 32) + "M /dev/urandom > /root/big && echo v1 > /root/file").code, 0);
  auto full = c.cli("checkpoint src", 300);
  EXPECT_EQ(full.exit_code, 1) << full.out << full.err;
  EXPECT_NE(full.err.find("No space left on device"), std::string::npos) << full.err;
  EXPECT_EQ(c.cli("snapshots").out, "ID  SOURCE  TYPE  LAYERS  LAYER-SIZE  AGE\n");
  EXPECT_EQ(stored_layers(c), baseline);
  EXPECT_TRUE(fs::is_empty(layers + "/tmp")) << run("ls -la " + shell_quote(layers + "/tmp")).out;
  // Thawed and running, with its id, token and files.
  EXPECT_FALSE(c.cgroup_frozen(id));
  EXPECT_EQ(c.get("src").value("state", ""), "running");
  EXPECT_EQ(sh(c, "src", token, "cat /root/file").out, "v1\n");

  // Room again: the checkpoint holds what the sandbox holds now.
  ASSERT_EQ(sh(c, "src", token, "rm /root/big && echo v2 > /root/file").code, 0);
  json again = checkpoint(c, "src");
  const std::string snap = again.value("snapshot_id", "");
  ASSERT_FALSE(snap.empty());
  json restored = create_with_agent(c, "restored", "--from " + snap);
  EXPECT_EQ(sh(c, "restored", token_of(restored), "cat /root/file; test -e /root/big || echo no-big").out, "v2\nno-big\n");
  ASSERT_EQ(c.cli("rm restored").exit_code, 0);
  ASSERT_EQ(c.cli("rm src").exit_code, 0);
  c.stop_node(SIGTERM);  // before the tmpfs goes
}

// The cost requirement: a checkpoint's layer is the bytes changed since the previous checkpoint, not the
// bytes the sandbox holds.
TEST(Snapshot, ACheckpointCostsTheChangedBytesNotTheSandboxSize) {
  Cluster c(own_store_with_proxy());
  import_test_image(c);
  for (int mib : {16, 64}) {
    const std::string name = "held" + std::to_string(mib);
    json box = create_with_agent(c, name, "-- /bin/sleep 3600");
    const std::string token = token_of(box);
    ASSERT_EQ(sh(c, name, token, "head -c " + std::to_string(mib) + "M /dev/urandom > /root/held").code, 0);
    json full = checkpoint(c, name);
    const uint64_t full_bytes = full["snapshot"].value("layer_bytes", uint64_t{0});
    EXPECT_GT(full_bytes, uint64_t(mib) << 20);
    ASSERT_EQ(sh(c, name, token, "head -c 1M /dev/urandom > /root/changed").code, 0);
    auto started = std::chrono::steady_clock::now();
    json delta = checkpoint(c, name);
    double total_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count();
    const uint64_t delta_bytes = delta["snapshot"].value("layer_bytes", uint64_t{0});
    EXPECT_GT(delta_bytes, uint64_t{1} << 20);
    EXPECT_LT(delta_bytes, uint64_t{2} << 20) << "the second checkpoint of a " << mib << " MiB sandbox";
    std::cout << "[ cost ] " << mib << " MiB held: first layer " << full_bytes << " B (frozen "
              << full.value("pause_ms", 0.0) << " ms); 1 MiB changed: layer " << delta_bytes << " B, frozen "
              << delta.value("pause_ms", 0.0) << " ms, CLI round trip " << total_ms << " ms\n";
    ASSERT_EQ(c.cli("rm " + name).exit_code, 0);
  }
}

}  // namespace
}  // namespace sg::e2e
