#include "snapshot/snapshot_store.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "tests/unit/snapshot/archive_builder.h"
#include "tests/unit/temp_dir.h"

namespace sg::snapshot {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

const std::string kLayerA = "sha256:" + std::string(64, 'a');
const std::string kLayerB = "sha256:" + std::string(64, 'b');

Snapshot sample(std::string id) {
  Snapshot s;
  s.id = std::move(id);
  s.type = "filesystem";
  s.source_id = "sb-aaaaaaaaaaaa";
  s.source_name = "box";
  s.driver = "process";
  s.image = "debian";
  s.layers = {kLayerA, kLayerB};
  s.layer = kLayerB;
  s.layer_bytes = 10240;
  s.command = {"/bin/sleep", "3600"};
  s.env = {{"PATH", "/bin"}, {"MODE", "a b"}};
  s.cwd = "/srv";
  s.ports = {{8080, false, "http1"}, {22, true, "tcp"}};
  s.created_at_ms = 1'700'000'000'000;
  return s;
}

TEST(SnapshotStore, RecordsRoundTripAndSurviveReopening) {
  TempDir tmp;
  std::string id = generate_snapshot_id();
  ASSERT_TRUE(check_snapshot_id(id)) << id;
  {
    auto store = SnapshotStore::open(tmp.path() + "/snapshots");
    ASSERT_TRUE(store) << store.message();
    ASSERT_TRUE(store->create(sample(id)));
    EXPECT_EQ(store->create(sample(id)).error(), Error::kAlreadyExists);
  }
  // What a crash in the middle of a write leaves: a temp file, removed at open, never listed.
  testing::write_file(tmp.path() + "/snapshots/." + generate_snapshot_id() + ".json.tmp-abcdef", "{\"id\":");
  auto store = SnapshotStore::open(tmp.path() + "/snapshots");
  ASSERT_TRUE(store) << store.message();
  auto all = store->list();
  ASSERT_TRUE(all) << all.message();
  ASSERT_EQ(all->size(), 1u);
  const Snapshot& got = (*all)[0];
  Snapshot want = sample(id);
  EXPECT_EQ(got.id, id);
  EXPECT_EQ(got.layers, want.layers);
  EXPECT_EQ(got.layer, want.layer);
  EXPECT_EQ(got.layer_bytes, want.layer_bytes);
  EXPECT_EQ(got.command, want.command);
  EXPECT_EQ(got.env, want.env);
  EXPECT_EQ(got.cwd, "/srv");
  ASSERT_EQ(got.ports.size(), 2u);
  EXPECT_EQ(got.ports[1].port, 22);
  EXPECT_TRUE(got.ports[1].is_public);
  EXPECT_EQ(got.ports[1].protocol, "tcp");
  EXPECT_EQ(got.created_at_ms, want.created_at_ms);
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(tmp.path() + "/snapshots")) files += e.is_regular_file() ? 1 : 0;
  EXPECT_EQ(files, 1u) << "the temp file of the interrupted write is still there";

  auto held = store->layers_in_use();
  ASSERT_TRUE(held) << held.message();
  EXPECT_EQ(*held, (std::set<std::string>{kLayerA, kLayerB}));
  auto user = store->first_user_of_image("debian");
  ASSERT_TRUE(user);
  EXPECT_EQ(user->value_or(""), "snapshot " + id);
  EXPECT_FALSE(store->first_user_of_image("other")->has_value());

  ASSERT_TRUE(store->remove(id));
  EXPECT_EQ(store->get(id).error(), Error::kNotFound);
  EXPECT_EQ(store->remove(id).error(), Error::kNotFound);
  EXPECT_TRUE(store->layers_in_use()->empty());
}

TEST(SnapshotStore, IdsAreCheckedBeforeTheyNameAFile) {
  TempDir tmp;
  auto store = SnapshotStore::open(tmp.path());
  ASSERT_TRUE(store) << store.message();
  for (std::string bad : {"", "snap-", "snap-ABCDEFGHIJKL", "snap-../../etc/x", "sb-abcdefghijkl", "snap-abcdefghijklm",
                          "snap-abc/efghijkl"}) {
    auto got = store->get(bad);
    ASSERT_FALSE(got) << bad;
    EXPECT_EQ(got.error(), Error::kInvalidArgument) << bad;
    EXPECT_NE(got.message().find("invalid snapshot id"), std::string::npos) << got.message();
    EXPECT_EQ(store->remove(bad).error(), Error::kInvalidArgument) << bad;
  }
  EXPECT_EQ(store->get("snap-abcdefghijkl").error(), Error::kNotFound);
}

TEST(SnapshotStore, ADamagedRecordFailsTheListSoItsLayersAreNeverCollected) {
  TempDir tmp;
  auto store = SnapshotStore::open(tmp.path());
  ASSERT_TRUE(store) << store.message();
  ASSERT_TRUE(store->create(sample("snap-aaaaaaaaaaaa")));
  testing::write_file(tmp.path() + "/snap-bbbbbbbbbbbb.json", "{\"id\": \"snap-bbbbbbbbbbbb\", \"layers\": 7}");
  auto all = store->list();
  ASSERT_FALSE(all);
  EXPECT_EQ(all.error(), Error::kIo);
  EXPECT_NE(all.message().find("snap-bbbbbbbbbbbb.json: damaged snapshot record"), std::string::npos) << all.message();
  EXPECT_FALSE(store->layers_in_use());
  // A record copied under another id's name is not that snapshot.
  fs::copy_file(tmp.path() + "/snap-aaaaaaaaaaaa.json", tmp.path() + "/snap-bbbbbbbbbbbb.json",
                fs::copy_options::overwrite_existing);
  auto copied = store->get("snap-bbbbbbbbbbbb");
  ASSERT_FALSE(copied);
  EXPECT_NE(copied.message().find("the record names snap-aaaaaaaaaaaa"), std::string::npos) << copied.message();
}

TEST(SnapshotStore, AMemorySnapshotKeepsItsShapeAndItsFilesGoWithItsRecordOrWithoutOne) {
  TempDir tmp;
  const std::string root = tmp.path() + "/snapshots";
  std::string id = generate_snapshot_id();
  Snapshot memory = sample(id);
  memory.type = "memory";
  memory.layers.clear();
  memory.layer.clear();
  memory.memory_mb = 256;
  memory.cpus = 1.5;
  memory.state_bytes = 123456;
  memory.ram_bytes = 1 << 20;
  memory.disk_bytes = 4096;
  memory.file_digests = {{"state", "sha256:" + std::string(64, 'a')}, {"ram", "sha256:" + std::string(64, 'b')}};
  // Files whose record never came (a crash before it) and a write in progress are swept at open; the
  // files of a record that exists stay.
  const std::string orphan = generate_snapshot_id(), half = generate_snapshot_id();
  {
    auto store = SnapshotStore::open(root);
    ASSERT_TRUE(store) << store.message();
    fs::create_directories(store->files_dir(id));
    testing::write_file(store->files_dir(id) + "/state", "saved");
    ASSERT_TRUE(store->create(memory));
    fs::create_directories(store->files_dir(orphan));
    fs::create_directories(store->new_files_dir(half));
  }
  auto store = SnapshotStore::open(root);
  ASSERT_TRUE(store) << store.message();
  EXPECT_TRUE(fs::exists(store->files_dir(id) + "/state"));
  EXPECT_FALSE(fs::exists(store->files_dir(orphan)));
  EXPECT_FALSE(fs::exists(store->new_files_dir(half)));
  auto got = store->get(id);
  ASSERT_TRUE(got) << got.message();
  EXPECT_EQ(got->type, "memory");
  EXPECT_EQ(got->memory_mb, 256u);
  EXPECT_EQ(got->cpus, 1.5);
  EXPECT_EQ(got->state_bytes, 123456u);
  EXPECT_EQ(got->ram_bytes, 1u << 20);
  EXPECT_EQ(got->file_digests, memory.file_digests);
  EXPECT_EQ(got->disk_bytes, 4096u);
  ASSERT_TRUE(store->remove(id));
  EXPECT_FALSE(fs::exists(store->files_dir(id)));

  // A memory record without its shape, or of an unknown type, is damaged, not guessed at.
  Snapshot shapeless = sample(generate_snapshot_id());
  shapeless.type = "memory";
  ASSERT_TRUE(store->create(shapeless));
  auto bad = store->get(shapeless.id);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find("field memory_mb"), std::string::npos) << bad.message();
  ASSERT_TRUE(store->remove(shapeless.id));  // a damaged record fails the list, and so the next create
  Snapshot odd = sample(generate_snapshot_id());
  odd.type = "disk";
  ASSERT_TRUE(store->create(odd));
  EXPECT_NE(store->get(odd.id).message().find("field type"), std::string::npos);
  ASSERT_TRUE(store->remove(odd.id));
  // A VM's filesystem snapshot: its disk in its files, and the snapshot whose disk it reads (its parent).
  Snapshot disk = sample(generate_snapshot_id());
  disk.layers.clear();
  disk.layer.clear();
  disk.file_digests = {{kDiskFile, "sha256:" + std::string(64, 'c')}};
  disk.parent = id;
  ASSERT_TRUE(store->create(disk));
  auto child = store->get(disk.id);
  ASSERT_TRUE(child) << child.message();
  EXPECT_TRUE(child->is_vm_disk());
  EXPECT_EQ(child->parent, id);
  auto first_child = store->first_child_of(id);
  ASSERT_TRUE(first_child);
  EXPECT_EQ(*first_child, std::optional<std::string>(disk.id));
  EXPECT_EQ(*store->first_child_of(disk.id), std::nullopt);
  // Marked removed: the record stays, rewritten whole, and still counts as its parent's child.
  EXPECT_FALSE(child->removed);
  ASSERT_TRUE(store->mark_removed(disk.id));
  auto marked = store->get(disk.id);
  ASSERT_TRUE(marked) << marked.message();
  EXPECT_TRUE(marked->removed);
  EXPECT_EQ(marked->parent, id);
  EXPECT_EQ(marked->file_digests, disk.file_digests);
  EXPECT_EQ(*store->first_child_of(id), std::optional<std::string>(disk.id));
  EXPECT_EQ(store->mark_removed(generate_snapshot_id()).error(), Error::kNotFound);
  ASSERT_TRUE(store->remove(disk.id));
  Snapshot bad_parent = disk;
  bad_parent.id = generate_snapshot_id();
  bad_parent.parent = "../snap-x";
  ASSERT_TRUE(store->create(bad_parent));
  EXPECT_NE(store->get(bad_parent.id).message().find("field parent"), std::string::npos);
  ASSERT_TRUE(store->remove(bad_parent.id));
  // A file digest naming a path outside the snapshot's directory, or no sha256, is damage too.
  for (const auto& [name, digest] : std::vector<std::pair<std::string, std::string>>{
           {"../ram", "sha256:" + std::string(64, 'a')}, {"ram", "md5:00"}}) {
    Snapshot pointing = memory;
    pointing.id = generate_snapshot_id();
    pointing.file_digests = {{name, digest}};
    ASSERT_TRUE(store->create(pointing));
    EXPECT_NE(store->get(pointing.id).message().find("field file_digests"), std::string::npos) << name;
    ASSERT_TRUE(store->remove(pointing.id));
  }
}

// A removed snapshot keeps only what its children read (its disk), and one whose last child went before a
// crash let it go too is taken at the next open, with the removed ones under it.
TEST(SnapshotStore, ARemovedSnapshotKeepsItsDiskAloneAndGoesAtOpenOnceNoChildReadsIt) {
  TempDir tmp;
  auto store = SnapshotStore::open(tmp.path());
  ASSERT_TRUE(store) << store.message();
  Snapshot grand = sample(generate_snapshot_id());
  grand.type = "memory";
  grand.memory_mb = 256;
  grand.cpus = 1;
  grand.layers.clear();
  grand.file_digests = {{kDiskFile, "sha256:" + std::string(64, 'a')},
                        {"ram", "sha256:" + std::string(64, 'b')},
                        {"state", "sha256:" + std::string(64, 'c')}};
  ASSERT_TRUE(store->create(grand));
  fs::create_directories(store->files_dir(grand.id));
  for (const char* f : {kDiskFile, "ram", "state"}) std::ofstream(store->files_dir(grand.id) + "/" + f) << f;
  Snapshot parent = grand;
  parent.id = generate_snapshot_id();
  parent.type = "filesystem";
  parent.file_digests = {{kDiskFile, "sha256:" + std::string(64, 'd')}};
  parent.parent = grand.id;
  ASSERT_TRUE(store->create(parent));
  Snapshot child = parent;
  child.id = generate_snapshot_id();
  child.parent = parent.id;
  ASSERT_TRUE(store->create(child));

  ASSERT_TRUE(store->mark_removed(grand.id));
  auto marked = store->get(grand.id);
  ASSERT_TRUE(marked) << marked.message();
  EXPECT_EQ(marked->file_digests.size(), 1u);
  EXPECT_TRUE(marked->file_digests.contains(kDiskFile));
  EXPECT_TRUE(fs::exists(store->files_dir(grand.id) + "/" + kDiskFile));
  EXPECT_FALSE(fs::exists(store->files_dir(grand.id) + "/ram")) << "a removed memory snapshot kept its RAM";
  EXPECT_FALSE(fs::exists(store->files_dir(grand.id) + "/state"));
  ASSERT_TRUE(store->mark_removed(parent.id));

  // Still read by `child`: a reopen keeps both.
  ASSERT_TRUE(SnapshotStore::open(tmp.path()));
  EXPECT_TRUE(store->get(grand.id));
  EXPECT_TRUE(store->get(parent.id));
  // The child goes, and the node dies before the removed ones under it go: the next open takes them.
  ASSERT_TRUE(store->remove(child.id));
  ASSERT_TRUE(SnapshotStore::open(tmp.path()));
  EXPECT_EQ(store->get(parent.id).error(), Error::kNotFound);
  EXPECT_EQ(store->get(grand.id).error(), Error::kNotFound);
  EXPECT_FALSE(fs::exists(store->files_dir(grand.id)));
}

}  // namespace
}  // namespace sg::snapshot
