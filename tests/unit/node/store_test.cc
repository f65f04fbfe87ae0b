#include "common/token_digest.h"
#include "noderuntime/store.h"

#include <gtest/gtest.h>
#include <sqlite3.h>

#include <fstream>

#include "noderuntime/names.h"
#include "tests/unit/node/fake_driver.h"

namespace sg {
namespace {

using testing::TempDir;

StoredSandbox sample(const std::string& id, SandboxState state = SandboxState::kRunning) {
  StoredSandbox s;
  s.spec.id = id;
  s.spec.name = "demo-" + id.substr(3, 4);
  s.spec.ephemeral = true;
  s.spec.command = {"python3", "-m", "http.server", "8080", "caf\xc3\xa9 \"quoted\"\n"};
  s.spec.env = {{"K", "V"}, {"EMPTY", ""}};
  s.spec.cwd = "/srv/app";
  s.spec.exposed_ports = {8080, 65535, 1};
  s.spec.timeout_secs = 604800;
  s.spec.cpus = 0.25;
  s.spec.memory_mb = 1048576;
  s.state = state;
  s.state_reason = "idle for 300 s";
  s.runtime.pid = 4321;
  s.runtime.start_time_ticks = 18446744073709551615ull;  // survives the trip through a signed column
  s.runtime.sandbox_dir = "/var/lib/sandgate/sandboxes/" + id;
  s.created_at_ms = 1764410400123;
  s.last_activity_at_ms = 1764410500456;
  s.spec.hibernate_after_secs = 3600;
  s.spec.image = "python-3.11";
  s.spec.uid_base = 0x10000000u + 7 * 65536;
  s.spec.pids_max = 4096;
  s.spec.disk_mb = 2048;
  s.spec.driver = "qemu";
  s.spec.snapshot = "snap-abcdefabcdef";
  s.spec.layers = {"sha256:" + std::string(64, 'c')};
  s.spec.memory_snapshot_dir = "/var/lib/sandgate/images/snapshots/snap-abcdefabcdef.d";
  s.spec.snapshot_disk = "/var/lib/sandgate/images/snapshots/snap-abcdefabcdef.d/disk.qcow2";
  s.tier = SuspendTier::kDisk;
  s.runtime.driver_data = {{"state_file", "/var/lib/sandgate/sandboxes/" + id + "/state"}, {"qmp", "q\"\n"}};
  s.spec.ports = {{8080, false, PortProtocol::kHttp1}, {65535, true, PortProtocol::kTcp}, {1, false, PortProtocol::kH2c}};
  s.spec.allow_unauthenticated_access = true;
  s.spec.agent_port = 9501;
  s.spec.token_sha256 = token_digest("sgt_sample-" + id);
  return s;
}

void expect_same(const StoredSandbox& a, const StoredSandbox& b) {
  EXPECT_EQ(a.spec.id, b.spec.id);
  EXPECT_EQ(a.spec.name, b.spec.name);
  EXPECT_EQ(a.spec.ephemeral, b.spec.ephemeral);
  EXPECT_EQ(a.spec.command, b.spec.command);
  EXPECT_EQ(a.spec.env, b.spec.env);
  EXPECT_EQ(a.spec.cwd, b.spec.cwd);
  EXPECT_EQ(a.spec.exposed_ports, b.spec.exposed_ports);
  EXPECT_EQ(a.spec.timeout_secs, b.spec.timeout_secs);
  EXPECT_DOUBLE_EQ(a.spec.cpus, b.spec.cpus);
  EXPECT_EQ(a.spec.memory_mb, b.spec.memory_mb);
  EXPECT_EQ(a.state, b.state);
  EXPECT_EQ(a.state_reason, b.state_reason);
  EXPECT_EQ(a.terminating, b.terminating);
  EXPECT_EQ(a.runtime.pid, b.runtime.pid);
  EXPECT_EQ(a.runtime.start_time_ticks, b.runtime.start_time_ticks);
  EXPECT_EQ(a.runtime.sandbox_dir, b.runtime.sandbox_dir);
  EXPECT_EQ(a.created_at_ms, b.created_at_ms);
  EXPECT_EQ(a.last_activity_at_ms, b.last_activity_at_ms);
  EXPECT_EQ(a.spec.hibernate_after_secs, b.spec.hibernate_after_secs);
  EXPECT_EQ(a.spec.image, b.spec.image);
  EXPECT_EQ(a.spec.uid_base, b.spec.uid_base);
  EXPECT_EQ(a.spec.pids_max, b.spec.pids_max);
  EXPECT_EQ(a.spec.disk_mb, b.spec.disk_mb);
  EXPECT_EQ(a.spec.driver, b.spec.driver);
  EXPECT_EQ(a.spec.snapshot, b.spec.snapshot);
  EXPECT_EQ(a.spec.layers, b.spec.layers);
  EXPECT_EQ(a.spec.memory_snapshot_dir, b.spec.memory_snapshot_dir);
  EXPECT_EQ(a.spec.snapshot_disk, b.spec.snapshot_disk);
  EXPECT_EQ(a.tier, b.tier);
  EXPECT_EQ(a.runtime.driver_data, b.runtime.driver_data);
  ASSERT_EQ(a.spec.ports.size(), b.spec.ports.size());
  for (size_t i = 0; i < a.spec.ports.size(); ++i) {
    EXPECT_EQ(a.spec.ports[i].port, b.spec.ports[i].port);
    EXPECT_EQ(a.spec.ports[i].is_public, b.spec.ports[i].is_public);
    EXPECT_EQ(a.spec.ports[i].protocol, b.spec.ports[i].protocol);
  }
  EXPECT_EQ(a.spec.allow_unauthenticated_access, b.spec.allow_unauthenticated_access);
  EXPECT_EQ(a.spec.agent_port, b.spec.agent_port);
  EXPECT_EQ(a.spec.token_sha256, b.spec.token_sha256);
}

std::string pragma_value(const std::string& path, const char* sql) {
  sqlite3* db = nullptr;
  if (sqlite3_open(path.c_str(), &db) != SQLITE_OK) return "";
  sqlite3_stmt* st = nullptr;
  sqlite3_prepare_v2(db, sql, -1, &st, nullptr);
  std::string v = sqlite3_step(st) == SQLITE_ROW ? reinterpret_cast<const char*>(sqlite3_column_text(st, 0)) : "";
  sqlite3_finalize(st);
  sqlite3_close(db);
  return v;
}

// A node.db written before the two-tier policy (schema 1) is upgraded in place and its rows keep working.
TEST(Store, MigratesSchemaOneRows) {
  TempDir dir;
  std::string path = dir.path() + "/node.db";
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  const char* v1 =
      "CREATE TABLE sandboxes (id TEXT PRIMARY KEY NOT NULL, name TEXT NOT NULL, spec TEXT NOT NULL, state TEXT NOT "
      "NULL, state_reason TEXT NOT NULL, pid INTEGER NOT NULL, start_time_ticks INTEGER NOT NULL, sandbox_dir TEXT "
      "NOT NULL, created_at_ms INTEGER NOT NULL, last_activity_at_ms INTEGER NOT NULL);"
      "INSERT INTO sandboxes VALUES ('sb-oldoldoldold', 'old', '{\"name\":\"old\",\"ephemeral\":false,"
      "\"command\":[\"sleep\"],\"env\":{},\"cwd\":\"/\",\"exposed_ports\":[],\"timeout_secs\":5,"
      "\"cpus\":1.0,\"memory_mb\":64}', 'suspended', 'r', 7, 8, '/d', 1, 2);"
      "PRAGMA user_version = 1;";
  ASSERT_EQ(sqlite3_exec(db, v1, nullptr, nullptr, nullptr), SQLITE_OK) << sqlite3_errmsg(db);
  sqlite3_close(db);
  auto store = Store::open(path);
  ASSERT_TRUE(store.ok()) << store.message();
  auto rows = (*store)->load_live();
  ASSERT_TRUE(rows.ok()) << rows.message();
  ASSERT_EQ(rows->size(), 1u);
  EXPECT_EQ((*rows)[0].spec.driver, "process");
  EXPECT_EQ((*rows)[0].spec.hibernate_after_secs, 0u);
  // Rows from before images and user namespaces: no image, no uid range, no pids limit.
  EXPECT_EQ((*rows)[0].spec.image, "");
  EXPECT_EQ((*rows)[0].spec.uid_base, 0u);
  EXPECT_EQ((*rows)[0].spec.pids_max, 0u);
  EXPECT_EQ((*rows)[0].tier, SuspendTier::kNone);
  EXPECT_TRUE((*rows)[0].runtime.driver_data.empty());
  EXPECT_EQ((*rows)[0].state, SandboxState::kSuspended);
  EXPECT_EQ(pragma_value(path, "PRAGMA user_version"), "4");
}

// A node.db from before edge authentication (schema 2): rows load with no token digest (only the operator
// token opens them), their exposed ports private http1, no agent; new rows keep their digest.
TEST(Store, MigratesSchemaTwoRows) {
  TempDir dir;
  std::string path = dir.path() + "/node.db";
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  const char* v2 =
      "CREATE TABLE sandboxes (id TEXT PRIMARY KEY NOT NULL, name TEXT NOT NULL, spec TEXT NOT NULL, state TEXT NOT "
      "NULL, state_reason TEXT NOT NULL, pid INTEGER NOT NULL, start_time_ticks INTEGER NOT NULL, sandbox_dir TEXT "
      "NOT NULL, created_at_ms INTEGER NOT NULL, last_activity_at_ms INTEGER NOT NULL, tier TEXT NOT NULL DEFAULT "
      "'', driver_data TEXT NOT NULL DEFAULT '{}');"
      "INSERT INTO sandboxes VALUES ('sb-oldoldoldold', 'old', '{\"name\":\"old\",\"ephemeral\":false,"
      "\"command\":[\"sleep\"],\"env\":{},\"cwd\":\"/\",\"exposed_ports\":[8080],\"timeout_secs\":5,"
      "\"hibernate_after_secs\":0,\"driver\":\"process\",\"cpus\":1.0,\"memory_mb\":64}', 'running', 'r', 7, 8, "
      "'/d', 1, 2, '', '{}');"
      "PRAGMA user_version = 2;";
  ASSERT_EQ(sqlite3_exec(db, v2, nullptr, nullptr, nullptr), SQLITE_OK) << sqlite3_errmsg(db);
  sqlite3_close(db);
  {
    auto store = Store::open(path);
    ASSERT_TRUE(store.ok()) << store.message();
    auto rows = (*store)->load_live();
    ASSERT_TRUE(rows.ok()) << rows.message();
    ASSERT_EQ(rows->size(), 1u);
    const SandboxSpec& old = (*rows)[0].spec;
    EXPECT_EQ(old.token_sha256, "");
    EXPECT_TRUE(old.ports.empty());
    EXPECT_FALSE(old.allow_unauthenticated_access);
    EXPECT_EQ(old.agent_port, 0);
    auto policy = port_policy(old, 8080);
    ASSERT_TRUE(policy.has_value());
    EXPECT_FALSE(policy->is_public);
    EXPECT_EQ(policy->protocol, PortProtocol::kHttp1);
    EXPECT_FALSE(port_policy(old, 9501).has_value());
    EXPECT_FALSE(token_matches_digest("anything", old.token_sha256));
    ASSERT_TRUE((*store)->upsert(sample("sb-newnewnewnew")).ok());
  }
  EXPECT_EQ(pragma_value(path, "PRAGMA user_version"), "4");
  auto store = Store::open(path);
  ASSERT_TRUE(store.ok()) << store.message();
  auto rows = (*store)->load_live();
  ASSERT_TRUE(rows.ok());
  ASSERT_EQ(rows->size(), 2u);
  EXPECT_TRUE(token_matches_digest("sgt_sample-sb-newnewnewnew", (*rows)[1].spec.token_sha256));
}

TEST(Store, RejectsDamagedPortPolicies) {
  for (const char* ports : {"5", "[{\"port\":0,\"public\":true,\"protocol\":\"tcp\"}]",
                            "[{\"port\":22,\"public\":1,\"protocol\":\"tcp\"}]",
                            "[{\"port\":22,\"public\":true,\"protocol\":\"udp\"}]", "[{\"port\":22}]", "[7]"}) {
    TempDir dir;
    std::string path = dir.path() + "/node.db";
    {
      auto store = Store::open(path);
      ASSERT_TRUE(store.ok());
      ASSERT_TRUE((*store)->upsert(sample("sb-aaaaaaaaaaaa")).ok());
    }
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
    std::string sql = std::string("UPDATE sandboxes SET spec = json_set(spec, '$.ports', json('") + ports + "'))";
    ASSERT_EQ(sqlite3_exec(db, sql.c_str(), nullptr, nullptr, nullptr), SQLITE_OK) << sqlite3_errmsg(db);
    sqlite3_close(db);
    auto store = Store::open(path);
    ASSERT_TRUE(store.ok());
    auto live = (*store)->load_live();
    ASSERT_TRUE(live.ok());
    EXPECT_TRUE(live->empty()) << ports;
  }
}

TEST(Store, RoundTripAcrossReopen) {
  TempDir dir;
  std::string path = dir.path() + "/node.db";
  StoredSandbox a = sample("sb-aaaaaaaaaaaa");
  StoredSandbox b = sample("sb-bbbbbbbbbbbb", SandboxState::kSuspended);
  b.spec.name = "";
  b.spec.ephemeral = false;
  b.terminating = true;  // a removal under way when the node stopped
  b.created_at_ms = a.created_at_ms + 1;
  {
    auto store = Store::open(path);
    ASSERT_TRUE(store.ok()) << store.message();
    ASSERT_TRUE((*store)->upsert(a).ok());
    ASSERT_TRUE((*store)->upsert(b).ok());
    auto live = (*store)->load_live();
    ASSERT_TRUE(live.ok());
    ASSERT_EQ(live->size(), 2u);
  }
  auto store = Store::open(path);
  ASSERT_TRUE(store.ok()) << store.message();
  auto live = (*store)->load_live();
  ASSERT_TRUE(live.ok()) << live.message();
  ASSERT_EQ(live->size(), 2u);
  expect_same((*live)[0], a);
  expect_same((*live)[1], b);
}

TEST(Store, UpsertReplacesAndEraseDeletes) {
  TempDir dir;
  auto store = Store::open(dir.path() + "/node.db");
  ASSERT_TRUE(store.ok());
  StoredSandbox a = sample("sb-aaaaaaaaaaaa");
  ASSERT_TRUE((*store)->upsert(a).ok());
  a.state = SandboxState::kSuspending;
  a.state_reason = "suspended on request";
  a.runtime.pid = 99;
  ASSERT_TRUE((*store)->upsert(a).ok());
  auto live = (*store)->load_live();
  ASSERT_EQ(live->size(), 1u);
  expect_same((*live)[0], a);
  ASSERT_TRUE((*store)->erase(a.spec.id).ok());
  ASSERT_TRUE((*store)->erase("sb-unknown0000").ok());
  EXPECT_TRUE((*store)->load_live()->empty());
}

TEST(Store, TerminatedRowsAreNotLive) {
  TempDir dir;
  auto store = Store::open(dir.path() + "/node.db");
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->upsert(sample("sb-aaaaaaaaaaaa", SandboxState::kTerminated)).ok());
  ASSERT_TRUE((*store)->upsert(sample("sb-bbbbbbbbbbbb", SandboxState::kFailed)).ok());
  auto live = (*store)->load_live();
  ASSERT_EQ(live->size(), 1u);
  EXPECT_EQ((*live)[0].spec.id, "sb-bbbbbbbbbbbb");
}

TEST(Store, UsesWalAndRecordsTheSchemaVersion) {
  TempDir dir;
  std::string path = dir.path() + "/node.db";
  ASSERT_TRUE(Store::open(path).ok());
  EXPECT_EQ(pragma_value(path, "PRAGMA journal_mode"), "wal");
  EXPECT_EQ(pragma_value(path, "PRAGMA user_version"), "4");
}

TEST(Store, RefusesANewerSchema) {
  TempDir dir;
  std::string path = dir.path() + "/node.db";
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(db, "PRAGMA user_version = 99", nullptr, nullptr, nullptr), SQLITE_OK);
  sqlite3_close(db);
  auto store = Store::open(path);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.error(), Error::kUnsupported);
  EXPECT_NE(store.message().find("99"), std::string::npos) << store.message();
}

TEST(Store, ErrorsAreValuesNotCrashes) {
  TempDir dir;
  auto missing_dir = Store::open(dir.path() + "/no/such/dir/node.db");
  ASSERT_FALSE(missing_dir.ok());
  EXPECT_EQ(missing_dir.error(), Error::kIo);

  std::string garbage = dir.path() + "/garbage.db";
  std::ofstream(garbage) << std::string(8192, 'x');
  auto not_a_db = Store::open(garbage);
  ASSERT_FALSE(not_a_db.ok());
  EXPECT_NE(not_a_db.message().find("sqlite"), std::string::npos) << not_a_db.message();
}

TEST(Store, SkipsADamagedRowButLoadsTheRest) {
  TempDir dir;
  std::string path = dir.path() + "/node.db";
  {
    auto store = Store::open(path);
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->upsert(sample("sb-aaaaaaaaaaaa")).ok());
    ASSERT_TRUE((*store)->upsert(sample("sb-bbbbbbbbbbbb")).ok());
  }
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(db, "UPDATE sandboxes SET spec = '{\"name\": 5}' WHERE id = 'sb-aaaaaaaaaaaa'", nullptr,
                         nullptr, nullptr),
            SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(db, "UPDATE sandboxes SET state = 'weird' WHERE id = 'sb-bbbbbbbbbbbb'", nullptr, nullptr,
                         nullptr),
            SQLITE_OK);
  sqlite3_close(db);
  auto store = Store::open(path);
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->upsert(sample("sb-cccccccccccc")).ok());
  auto live = (*store)->load_live();
  ASSERT_TRUE(live.ok());
  ASSERT_EQ(live->size(), 1u);
  EXPECT_EQ((*live)[0].spec.id, "sb-cccccccccccc");
}

}  // namespace
}  // namespace sg
