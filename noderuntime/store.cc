#include "noderuntime/store.h"

#include <spdlog/spdlog.h>
#include <sqlite3.h>

#include <nlohmann/json.hpp>

namespace sg {
namespace {

using json = nlohmann::json;

constexpr int kSchemaVersion = 4;

Failure sqlite_failure(sqlite3* db, std::string_view what) {
  return fail(Error::kIo, "sqlite " + std::string(what) + ": " + (db ? sqlite3_errmsg(db) : "out of memory"));
}

std::string spec_to_json(const SandboxSpec& spec) {
  json ports = json::array();
  for (const PortPolicy& p : spec.ports)
    ports.push_back({{"port", p.port}, {"public", p.is_public}, {"protocol", protocol_name(p.protocol)}});
  json j = {{"name", spec.name},
            {"ephemeral", spec.ephemeral},
            {"command", spec.command},
            {"env", spec.env},
            {"cwd", spec.cwd},
            {"exposed_ports", spec.exposed_ports},
            {"ports", ports},
            {"allow_unauthenticated_access", spec.allow_unauthenticated_access},
            {"agent_port", spec.agent_port},
            {"timeout_secs", spec.timeout_secs},
            {"hibernate_after_secs", spec.hibernate_after_secs},
            {"driver", spec.driver},
            {"cpus", spec.cpus},
            {"memory_mb", spec.memory_mb},
            {"image", spec.image},
            {"snapshot", spec.snapshot},
            {"layers", spec.layers},
            {"memory_snapshot_dir", spec.memory_snapshot_dir},
            {"snapshot_disk", spec.snapshot_disk},
            {"pids_max", spec.pids_max},
            {"disk_mb", spec.disk_mb},
            {"uid_base", spec.uid_base},
            {"allow_internet_access", spec.allow_internet_access},
            {"allow_out", spec.allow_out},
            {"deny_out", spec.deny_out}};
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

// The stored spec was written by spec_to_json, but a damaged file must not crash the node: every access
// is type-checked and a mismatch names the field.
Result<SandboxSpec> spec_from_json(const std::string& id, const std::string& text) {
  json j = json::parse(text, nullptr, false);
  auto bad = [&id](std::string_view field) {
    return fail(Error::kIo, "stored spec of " + id + " is damaged (field " + std::string(field) + ")");
  };
  if (!j.is_object()) return bad("<root>");
  SandboxSpec spec;
  spec.id = id;
  auto field = [&j](const char* key) -> const json* {
    auto it = j.find(key);
    return it == j.end() ? nullptr : &*it;
  };
  const json* v = field("name");
  if (!v || !v->is_string()) return bad("name");
  spec.name = v->get<std::string>();
  if (!(v = field("ephemeral")) || !v->is_boolean()) return bad("ephemeral");
  spec.ephemeral = v->get<bool>();
  if (!(v = field("command")) || !v->is_array()) return bad("command");
  for (const json& arg : *v) {
    if (!arg.is_string()) return bad("command");
    spec.command.push_back(arg.get<std::string>());
  }
  if (!(v = field("env")) || !v->is_object()) return bad("env");
  for (auto it = v->begin(); it != v->end(); ++it) {
    if (!it.value().is_string()) return bad("env");
    spec.env[it.key()] = it.value().get<std::string>();
  }
  if (!(v = field("cwd")) || !v->is_string()) return bad("cwd");
  spec.cwd = v->get<std::string>();
  if (!(v = field("exposed_ports")) || !v->is_array()) return bad("exposed_ports");
  for (const json& port : *v) {
    if (!port.is_number_unsigned() || port.get<uint64_t>() > 65535) return bad("exposed_ports");
    spec.exposed_ports.push_back(static_cast<uint16_t>(port.get<uint64_t>()));
  }
  if (!(v = field("timeout_secs")) || !v->is_number_unsigned()) return bad("timeout_secs");
  spec.timeout_secs = static_cast<uint32_t>(v->get<uint64_t>());
  if (!(v = field("cpus")) || !v->is_number()) return bad("cpus");
  spec.cpus = v->get<double>();
  if (!(v = field("memory_mb")) || !v->is_number_unsigned()) return bad("memory_mb");
  spec.memory_mb = static_cast<uint32_t>(v->get<uint64_t>());
  // Added with images and user namespaces (issue 10); older rows have neither and keep the defaults.
  if ((v = field("image"))) {
    if (!v->is_string()) return bad("image");
    spec.image = v->get<std::string>();
  }
  // Added with snapshots (issue 11); older rows have none.
  if ((v = field("snapshot"))) {
    if (!v->is_string()) return bad("snapshot");
    spec.snapshot = v->get<std::string>();
  }
  if ((v = field("layers"))) {
    if (!v->is_array()) return bad("layers");
    for (const json& d : *v) {
      if (!d.is_string()) return bad("layers");
      spec.layers.push_back(d.get<std::string>());
    }
  }
  if ((v = field("memory_snapshot_dir"))) {  // added with memory snapshots
    if (!v->is_string()) return bad("memory_snapshot_dir");
    spec.memory_snapshot_dir = v->get<std::string>();
  }
  if ((v = field("snapshot_disk"))) {  // added with the disk checkpoints of QEMU sandboxes
    if (!v->is_string()) return bad("snapshot_disk");
    spec.snapshot_disk = v->get<std::string>();
  }
  if ((v = field("pids_max"))) {
    if (!v->is_number_unsigned() || v->get<uint64_t>() > UINT32_MAX) return bad("pids_max");
    spec.pids_max = static_cast<uint32_t>(v->get<uint64_t>());
  }
  if ((v = field("disk_mb"))) {
    if (!v->is_number_unsigned() || v->get<uint64_t>() > UINT32_MAX) return bad("disk_mb");
    spec.disk_mb = static_cast<uint32_t>(v->get<uint64_t>());
  }
  if ((v = field("uid_base"))) {
    if (!v->is_number_unsigned() || v->get<uint64_t>() > UINT32_MAX) return bad("uid_base");
    spec.uid_base = static_cast<uint32_t>(v->get<uint64_t>());
  }
  // Added with egress; older rows have no internet access, as they had none.
  if ((v = field("allow_internet_access"))) {
    if (!v->is_boolean()) return bad("allow_internet_access");
    spec.allow_internet_access = v->get<bool>();
  }
  for (auto [key, list] : {std::pair{"allow_out", &spec.allow_out}, std::pair{"deny_out", &spec.deny_out}}) {
    if (!(v = field(key))) continue;
    if (!v->is_array()) return bad(key);
    for (const json& entry : *v) {
      if (!entry.is_string()) return bad(key);
      list->push_back(entry.get<std::string>());
    }
  }
  // Added with the two-tier idle policy: rows written before it have neither and keep the defaults.
  if ((v = field("hibernate_after_secs"))) {
    if (!v->is_number_unsigned()) return bad("hibernate_after_secs");
    spec.hibernate_after_secs = static_cast<uint32_t>(v->get<uint64_t>());
  }
  if ((v = field("driver"))) {
    if (!v->is_string()) return bad("driver");
    spec.driver = v->get<std::string>();
  }
  // Added with edge authentication (schema v3). Older rows keep the defaults: their ports private http1
  // (port_policy), no agent (they were started without one).
  if ((v = field("ports"))) {
    if (!v->is_array()) return bad("ports");
    for (const json& p : *v) {
      auto port = p.is_object() ? p.find("port") : json::const_iterator();
      auto is_public = p.is_object() ? p.find("public") : json::const_iterator();
      auto protocol = p.is_object() ? p.find("protocol") : json::const_iterator();
      if (!p.is_object() || port == p.end() || is_public == p.end() || protocol == p.end() ||
          !port->is_number_unsigned() || port->get<uint64_t>() < 1 || port->get<uint64_t>() > 65535 ||
          !is_public->is_boolean() || !protocol->is_string())
        return bad("ports");
      auto parsed = parse_protocol(protocol->get<std::string>());
      if (!parsed) return bad("ports");
      spec.ports.push_back(
          PortPolicy{static_cast<uint16_t>(port->get<uint64_t>()), is_public->get<bool>(), *parsed});
    }
  }
  if ((v = field("allow_unauthenticated_access"))) {
    if (!v->is_boolean()) return bad("allow_unauthenticated_access");
    spec.allow_unauthenticated_access = v->get<bool>();
  }
  if ((v = field("agent_port"))) {
    if (!v->is_number_unsigned() || v->get<uint64_t>() > 65535) return bad("agent_port");
    spec.agent_port = static_cast<uint16_t>(v->get<uint64_t>());
  }
  return spec;
}

std::string driver_data_to_json(const std::map<std::string, std::string>& data) {
  return json(data).dump(-1, ' ', false, json::error_handler_t::replace);
}

Result<std::map<std::string, std::string>> driver_data_from_json(const std::string& id, const std::string& text) {
  json j = json::parse(text, nullptr, false);
  auto bad = fail(Error::kIo, "stored driver data of " + id + " is damaged");
  if (!j.is_object()) return bad;
  std::map<std::string, std::string> out;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (!it.value().is_string()) return bad;
    out[it.key()] = it.value().get<std::string>();
  }
  return out;
}

std::string column_text(sqlite3_stmt* stmt, int col) {
  const unsigned char* text = sqlite3_column_text(stmt, col);
  if (text == nullptr) return {};
  return std::string(reinterpret_cast<const char*>(text), static_cast<size_t>(sqlite3_column_bytes(stmt, col)));
}

// SQLITE_STATIC: the text outlives the statement's execution (bindings are cleared right after).
bool bind_text(sqlite3_stmt* stmt, int index, std::string_view text) {
  return sqlite3_bind_text(stmt, index, text.data(), static_cast<int>(text.size()), SQLITE_STATIC) == SQLITE_OK;
}

// Statements are reused; a reset afterwards releases read locks and makes them ready for the next call.
class StatementScope {
 public:
  explicit StatementScope(sqlite3_stmt* stmt) : stmt_(stmt) {}
  ~StatementScope() {
    sqlite3_reset(stmt_);
    sqlite3_clear_bindings(stmt_);
  }
  StatementScope(const StatementScope&) = delete;
  StatementScope& operator=(const StatementScope&) = delete;

 private:
  sqlite3_stmt* stmt_;
};

}  // namespace

Result<std::unique_ptr<Store>> Store::open(const std::string& path) {
  sqlite3* db = nullptr;
  int flags = SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX;  // one thread: the node's loop
  int rc = sqlite3_open_v2(path.c_str(), &db, flags, nullptr);
  if (rc != SQLITE_OK) {
    Failure f = sqlite_failure(db, "open " + path);
    sqlite3_close(db);
    return f;
  }
  std::unique_ptr<Store> store(new Store(db));
  // Another process holding a lock (an old node still shutting down, a backup) gets a few seconds, not
  // an immediate SQLITE_BUSY.
  sqlite3_busy_timeout(db, 5000);
  // WAL + NORMAL: commits do not fsync (a power cut may lose the last transitions, never corrupt the file);
  // reconcile re-derives the truth from the running instances anyway.
  if (auto s = store->exec("PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"); !s)
    return s.failure();
  if (auto s = store->migrate(); !s) return s.failure();
  auto upsert = store->prepare(
      "INSERT INTO sandboxes (id, name, spec, state, state_reason, pid, start_time_ticks, sandbox_dir, "
      "created_at_ms, last_activity_at_ms, tier, driver_data, token_sha256, terminating) VALUES (?1, ?2, ?3, ?4, "
      "?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14) "
      "ON CONFLICT(id) DO UPDATE SET name=excluded.name, spec=excluded.spec, state=excluded.state, "
      "state_reason=excluded.state_reason, pid=excluded.pid, start_time_ticks=excluded.start_time_ticks, "
      "sandbox_dir=excluded.sandbox_dir, created_at_ms=excluded.created_at_ms, "
      "last_activity_at_ms=excluded.last_activity_at_ms, tier=excluded.tier, driver_data=excluded.driver_data, "
      "token_sha256=excluded.token_sha256, terminating=excluded.terminating");
  if (!upsert) return upsert.failure();
  store->upsert_stmt_ = *upsert;
  auto erase = store->prepare("DELETE FROM sandboxes WHERE id = ?1");
  if (!erase) return erase.failure();
  store->erase_stmt_ = *erase;
  return store;
}

Store::~Store() {
  sqlite3_finalize(upsert_stmt_);
  sqlite3_finalize(erase_stmt_);
  sqlite3_close(db_);
}

Status Store::exec(const char* sql) {
  char* err = nullptr;
  if (sqlite3_exec(db_, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    std::string msg = std::string("sqlite: ") + (err ? err : sqlite3_errmsg(db_)) + " (in: " + sql + ")";
    sqlite3_free(err);
    return fail(Error::kIo, std::move(msg));
  }
  return {};
}

Result<sqlite3_stmt*> Store::prepare(const char* sql) {
  sqlite3_stmt* stmt = nullptr;
  if (sqlite3_prepare_v3(db_, sql, -1, SQLITE_PREPARE_PERSISTENT, &stmt, nullptr) != SQLITE_OK)
    return sqlite_failure(db_, "prepare");
  return stmt;
}

// user_version records the schema the file has; each step upgrades by one version inside a transaction.
Status Store::migrate() {
  sqlite3_stmt* stmt = nullptr;
  if (sqlite3_prepare_v2(db_, "PRAGMA user_version", -1, &stmt, nullptr) != SQLITE_OK)
    return sqlite_failure(db_, "read user_version");
  int version = sqlite3_step(stmt) == SQLITE_ROW ? sqlite3_column_int(stmt, 0) : -1;
  sqlite3_finalize(stmt);
  if (version < 0) return sqlite_failure(db_, "read user_version");
  if (version > kSchemaVersion)
    return fail(Error::kUnsupported, "node.db has schema version " + std::to_string(version) +
                                         ", newer than this sandgate-node supports (" +
                                         std::to_string(kSchemaVersion) + "); upgrade sandgate-node");
  if (version == 0) {
    auto s = exec(
        "BEGIN IMMEDIATE;"
        "CREATE TABLE IF NOT EXISTS sandboxes ("
        "  id TEXT PRIMARY KEY NOT NULL,"
        "  name TEXT NOT NULL,"
        "  spec TEXT NOT NULL,"
        "  state TEXT NOT NULL,"
        "  state_reason TEXT NOT NULL,"
        "  pid INTEGER NOT NULL,"
        "  start_time_ticks INTEGER NOT NULL,"
        "  sandbox_dir TEXT NOT NULL,"
        "  created_at_ms INTEGER NOT NULL,"
        "  last_activity_at_ms INTEGER NOT NULL);"
        "PRAGMA user_version = 1;"
        "COMMIT;");
    if (!s) {
      (void)exec("ROLLBACK");
      return s;
    }
    version = 1;
  }
  if (version == 1) {
    auto s = exec(
        "BEGIN IMMEDIATE;"
        "ALTER TABLE sandboxes ADD COLUMN tier TEXT NOT NULL DEFAULT '';"
        "ALTER TABLE sandboxes ADD COLUMN driver_data TEXT NOT NULL DEFAULT '{}';"
        "PRAGMA user_version = 2;"
        "COMMIT;");
    if (!s) {
      (void)exec("ROLLBACK");
      return s;
    }
    version = 2;
  }
  if (version == 2) {
    // A column rather than a spec field: the digest is a credential, kept apart from what is shown and
    // logged. Rows from before have none ('') and accept only the operator token.
    auto s = exec(
        "BEGIN IMMEDIATE;"
        "ALTER TABLE sandboxes ADD COLUMN token_sha256 TEXT NOT NULL DEFAULT '';"
        "PRAGMA user_version = 3;"
        "COMMIT;");
    if (!s) {
      (void)exec("ROLLBACK");
      return s;
    }
    version = 3;
  }
  if (version == 3) {
    auto s = exec(
        "BEGIN IMMEDIATE;"
        "ALTER TABLE sandboxes ADD COLUMN terminating INTEGER NOT NULL DEFAULT 0;"
        "PRAGMA user_version = 4;"
        "COMMIT;");
    if (!s) {
      (void)exec("ROLLBACK");
      return s;
    }
  }
  return {};
}

Status Store::upsert(const StoredSandbox& s) {
  StatementScope scope(upsert_stmt_);
  std::string spec = spec_to_json(s.spec);
  std::string driver_data = driver_data_to_json(s.runtime.driver_data);
  std::string_view state = state_name(s.state);
  sqlite3_stmt* st = upsert_stmt_;
  bool bound = bind_text(st, 1, s.spec.id) && bind_text(st, 2, s.spec.name) && bind_text(st, 3, spec) &&
               bind_text(st, 4, state) && bind_text(st, 5, s.state_reason) &&
               sqlite3_bind_int64(st, 6, s.runtime.pid) == SQLITE_OK &&
               sqlite3_bind_int64(st, 7, static_cast<sqlite3_int64>(s.runtime.start_time_ticks)) == SQLITE_OK &&
               bind_text(st, 8, s.runtime.sandbox_dir) && sqlite3_bind_int64(st, 9, s.created_at_ms) == SQLITE_OK &&
               sqlite3_bind_int64(st, 10, s.last_activity_at_ms) == SQLITE_OK && bind_text(st, 11, tier_name(s.tier)) &&
               bind_text(st, 12, driver_data) && bind_text(st, 13, s.spec.token_sha256) &&
               sqlite3_bind_int64(st, 14, s.terminating ? 1 : 0) == SQLITE_OK;
  if (!bound) return sqlite_failure(db_, "bind sandbox " + s.spec.id);
  if (sqlite3_step(upsert_stmt_) != SQLITE_DONE) return sqlite_failure(db_, "save sandbox " + s.spec.id);
  return {};
}

Status Store::erase(const std::string& id) {
  StatementScope scope(erase_stmt_);
  if (!bind_text(erase_stmt_, 1, id))
    return sqlite_failure(db_, "bind sandbox " + id);
  if (sqlite3_step(erase_stmt_) != SQLITE_DONE) return sqlite_failure(db_, "delete sandbox " + id);
  return {};
}

Result<std::vector<StoredSandbox>> Store::load_live() {
  auto stmt = prepare(
      "SELECT id, spec, state, state_reason, pid, start_time_ticks, sandbox_dir, created_at_ms, last_activity_at_ms, "
      "tier, driver_data, token_sha256, terminating FROM sandboxes WHERE state != 'terminated' ORDER BY "
      "created_at_ms, id");
  if (!stmt) return stmt.failure();
  std::vector<StoredSandbox> out;
  int rc;
  while ((rc = sqlite3_step(*stmt)) == SQLITE_ROW) {
    std::string id = column_text(*stmt, 0);
    auto spec = spec_from_json(id, column_text(*stmt, 1));
    auto state = parse_state(column_text(*stmt, 2));
    auto tier = parse_tier(column_text(*stmt, 9));
    auto driver_data = driver_data_from_json(id, column_text(*stmt, 10));
    // One damaged row must not keep the node from adopting every other sandbox.
    if (!spec || !state || !tier || !driver_data) {
      spdlog::error("skipping sandbox {} in node.db: {}", id,
                    !spec ? spec.message() : !state ? "unknown state" : !tier ? "unknown tier" : driver_data.message());
      continue;
    }
    StoredSandbox s;
    s.spec = std::move(*spec);
    s.spec.token_sha256 = column_text(*stmt, 11);
    s.terminating = sqlite3_column_int64(*stmt, 12) != 0;
    s.state = *state;
    s.state_reason = column_text(*stmt, 3);
    s.runtime.pid = static_cast<int>(sqlite3_column_int64(*stmt, 4));
    s.runtime.start_time_ticks = static_cast<uint64_t>(sqlite3_column_int64(*stmt, 5));
    s.runtime.sandbox_dir = column_text(*stmt, 6);
    s.created_at_ms = sqlite3_column_int64(*stmt, 7);
    s.last_activity_at_ms = sqlite3_column_int64(*stmt, 8);
    s.tier = *tier;
    s.runtime.driver_data = std::move(*driver_data);
    out.push_back(std::move(s));
  }
  if (rc != SQLITE_DONE) {
    Failure failure = sqlite_failure(db_, "load sandboxes");
    sqlite3_finalize(*stmt);
    return failure;
  }
  sqlite3_finalize(*stmt);
  return out;
}

}  // namespace sg
