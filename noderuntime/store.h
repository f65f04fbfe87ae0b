// Durable record of the node's sandboxes (SQLite, <state_dir>/node.db) so a restarted node can find and
// adopt the instances it started. One row per sandbox; the spec is stored as JSON text so adding a spec
// field needs no schema migration. Writes happen on transitions, never per byte of traffic.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "noderuntime/sandbox.h"

struct sqlite3;
struct sqlite3_stmt;

namespace sg {

struct StoredSandbox {
  SandboxSpec spec;
  SandboxState state = SandboxState::kCreating;
  std::string state_reason;
  SuspendTier tier = SuspendTier::kNone;  // see SandboxInfo::tier
  RuntimeInfo runtime;
  int64_t created_at_ms = 0;        // Unix epoch milliseconds (wall clock)
  int64_t last_activity_at_ms = 0;  // Unix epoch milliseconds (wall clock)
  // Its removal began (`rm`, an ephemeral sandbox's end): a node that restarts before it finished finishes it.
  bool terminating = false;
};

class Store {
 public:
  // Opens (creating if needed) the database at `path` and brings its schema to the current version.
  static Result<std::unique_ptr<Store>> open(const std::string& path);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Inserts or replaces the row for s.spec.id.
  Status upsert(const StoredSandbox& s);
  // Deletes the row (a terminated sandbox needs no adopting). A no-op for unknown ids.
  Status erase(const std::string& id);
  // Every sandbox not in state terminated, oldest first.
  Result<std::vector<StoredSandbox>> load_live();

 private:
  explicit Store(sqlite3* db) : db_(db) {}
  Status exec(const char* sql);
  Status migrate();
  Result<sqlite3_stmt*> prepare(const char* sql);

  sqlite3* db_;
  sqlite3_stmt* upsert_stmt_ = nullptr;
  sqlite3_stmt* erase_stmt_ = nullptr;
};

}  // namespace sg
