// Contract tests of the Firecracker driver against ../shared/specs/firecracker.yaml (served by a fake, not a
// running Firecracker), the spec validator itself, and the HTTP-over-unix-socket client's faults.
#include "noderuntime/firecracker_driver.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <filesystem>
#include <fstream>
#include <optional>

#include "tests/unit/node/fake_hypervisor.h"

namespace sg {
namespace {

using json = nlohmann::json;
using testing::ApiSpec;
using testing::FakeHypervisor;
using testing::TempDir;
using testing::TestLoop;

// Every operation the driver sends, as the spec names them.
const std::set<std::string> kFirecrackerOps = {
    "PUT /machine-config", "PUT /boot-source", "PUT /drives/{drive_id}", "PUT /network-interfaces/{iface_id}",
    "PUT /vsock",          "PUT /actions",     "PATCH /vm",              "PUT /snapshot/create",
    "PUT /snapshot/load",  "GET /"};

std::string joined(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += "\n  " + s;
  return out;
}

bool mentions(const std::vector<std::string>& problems, std::string_view what) {
  for (const auto& p : problems) {
    if (p.find(what) != std::string::npos) return true;
  }
  return false;
}

class SpecFirecracker : public ::testing::Test {
 protected:
  void SetUp() override {
    spec_ = testing::load_spec("firecracker.yaml");
    if (!spec_) GTEST_SKIP() << "../shared/specs missing: Firecracker driver NOT verified against its spec";
  }
  std::vector<std::string> check(const std::string& method, const std::string& target, const std::string& body) {
    std::string ct = "application/json";
    return spec_->check_request(method, target, body.empty() ? nullptr : &ct, body).problems;
  }
  std::unique_ptr<ApiSpec> spec_;
};

TEST_F(SpecFirecracker, DefinesEveryOperationTheDriverUses) {
  auto ops = spec_->operations();
  for (const auto& op : kFirecrackerOps) EXPECT_TRUE(ops.count(op)) << op;
}

TEST_F(SpecFirecracker, AcceptsConformingBodies) {
  EXPECT_EQ(joined(check("PUT", "/machine-config", R"({"vcpu_count":2,"mem_size_mib":256,"smt":false})")), "");
  EXPECT_EQ(joined(check("PUT", "/drives/rootfs",
                         R"({"drive_id":"rootfs","path_on_host":"/r","is_root_device":true,"is_read_only":false})")),
            "");
  EXPECT_EQ(joined(check("PUT", "/snapshot/load",
                         R"({"snapshot_path":"/s","mem_backend":{"backend_type":"Uffd","backend_path":"/u"}})")),
            "");
  EXPECT_EQ(joined(check("PATCH", "/vm", R"({"state":"Paused"})")), "");
}

TEST_F(SpecFirecracker, CatchesMissingRequiredFields) {
  EXPECT_TRUE(mentions(check("PUT", "/machine-config", R"({"vcpu_count":2})"), "'mem_size_mib' is missing"));
  EXPECT_TRUE(mentions(check("PUT", "/vsock", R"({"guest_cid":3})"), "'uds_path' is missing"));
  // Nested through a $ref: MemoryBackend.backend_path.
  EXPECT_TRUE(mentions(check("PUT", "/snapshot/load", R"({"snapshot_path":"/s","mem_backend":{"backend_type":"File"}})"),
                       "body.mem_backend: required field 'backend_path' is missing"));
  EXPECT_TRUE(mentions(check("PUT", "/actions", ""), "request body is required"));
  // The spec's prose rule: exactly one memory source.
  EXPECT_TRUE(mentions(check("PUT", "/snapshot/load", R"({"snapshot_path":"/s"})"), "exactly one of mem_backend"));
  EXPECT_TRUE(mentions(check("PUT", "/snapshot/load",
                             R"({"snapshot_path":"/s","mem_file_path":"/m","mem_backend":{"backend_type":"File","backend_path":"/m"}})"),
                       "exactly one of mem_backend"));
}

TEST_F(SpecFirecracker, CatchesBadEnumValues) {
  EXPECT_TRUE(mentions(check("PATCH", "/vm", R"({"state":"Sleeping"})"), "not one of the enum values"));
  EXPECT_TRUE(mentions(check("PUT", "/actions", R"({"action_type":"InstanceStop"})"), "enum"));
  EXPECT_TRUE(mentions(check("PUT", "/snapshot/create", R"({"snapshot_path":"/s","mem_file_path":"/m","snapshot_type":"full"})"),
                       "enum"));
  EXPECT_TRUE(mentions(check("PUT", "/snapshot/load",
                             R"({"snapshot_path":"/s","mem_backend":{"backend_type":"Disk","backend_path":"/m"}})"),
                       "body.mem_backend.backend_type"));
}

TEST_F(SpecFirecracker, CatchesTypesRangesAndUnknownFields) {
  EXPECT_TRUE(mentions(check("PUT", "/machine-config", R"({"vcpu_count":"2","mem_size_mib":256})"), "expected integer"));
  EXPECT_TRUE(mentions(check("PUT", "/machine-config", R"({"vcpu_count":0,"mem_size_mib":256})"), "below the minimum"));
  EXPECT_TRUE(mentions(check("PUT", "/machine-config", R"({"vcpu_count":33,"mem_size_mib":256})"), "above the maximum"));
  EXPECT_TRUE(mentions(check("PUT", "/vsock", R"({"guest_cid":2,"uds_path":"/v"})"), "below the minimum"));
  EXPECT_TRUE(mentions(check("PUT", "/vsock", R"({"guest_cid":3,"uds_path":"/v","cid":3})"), "unknown field 'cid'"));
  EXPECT_TRUE(mentions(check("PUT", "/boot-source", R"({"kernel_image_path":"/k","bootargs":"x"})"), "unknown field"));
}

TEST_F(SpecFirecracker, CatchesPathsMethodsAndFraming) {
  EXPECT_TRUE(mentions(check("PUT", "/snapshot", R"({})"), "not in the spec"));
  EXPECT_TRUE(mentions(check("PUT", "/vm", R"({"state":"Paused"})"), "method PUT is not defined for /vm"));
  EXPECT_TRUE(mentions(check("GET", "/drives/rootfs", ""), "method GET is not defined"));
  EXPECT_TRUE(mentions(check("PUT", "/drives/a/b", R"({})"), "not in the spec"));
  EXPECT_TRUE(mentions(check("PATCH", "/vm", "{not json"), "not JSON"));
  auto no_ct = spec_->check_request("PATCH", "/vm", nullptr, R"({"state":"Paused"})").problems;
  EXPECT_TRUE(mentions(no_ct, "Content-Type must be application/json"));
}

// ---- the HTTP client's transport faults ----

class HypervisorClientTest : public SpecFirecracker {
 protected:
  void SetUp() override {
    SpecFirecracker::SetUp();
    if (IsSkipped()) return;
    fake_ = std::make_unique<FakeHypervisor>(*spec_, dir_.path() + "/api.sock");
  }
  Result<HypervisorResponse> call(HypervisorClientOptions o, std::string method, std::string path, std::string body,
                                  std::string socket = {}) {
    HypervisorClient client(loop_.get(), socket.empty() ? fake_->socket_path() : socket, "firecracker", o);
    std::optional<Result<HypervisorResponse>> got;
    client.request(method, path, std::move(body), [&](Result<HypervisorResponse> r) { got = std::move(r); });
    EXPECT_FALSE(got.has_value()) << "callback ran before request() returned";
    EXPECT_TRUE(loop_.run_until([&] { return got.has_value(); }));
    return got ? std::move(*got) : Result<HypervisorResponse>(fail(Error::kInternal, "no answer"));
  }
  TempDir dir_;
  TestLoop loop_;
  std::unique_ptr<FakeHypervisor> fake_;
};

TEST_F(HypervisorClientTest, ParsesAnAnswer) {
  auto r = call({}, "PATCH", "/vm", R"({"state":"Paused"})");
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(r->status, 204);
  EXPECT_EQ(joined(fake_->problems()), "");
}

TEST_F(HypervisorClientTest, TimesOutWhenTheHypervisorDoesNotAnswer) {
  fake_->inject("PATCH /vm", FakeHypervisor::Fault::kNoAnswer);
  auto start = std::chrono::steady_clock::now();
  auto r = call({.timeout_ms = 150}, "PATCH", "/vm", R"({"state":"Paused"})");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error(), Error::kTimeout);
  EXPECT_NE(r.message().find("did not answer within 150 ms"), std::string::npos) << r.message();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
}

TEST_F(HypervisorClientTest, ReportsAConnectionClosedMidResponse) {
  fake_->set_response_fields("GET /", {{"state", "Running"}});
  fake_->inject("GET /", FakeHypervisor::Fault::kCloseMidResponse);
  auto r = call({}, "GET", "/", "");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error(), Error::kUnavailable);
  EXPECT_NE(r.message().find("before a complete answer"), std::string::npos) << r.message();
}

TEST_F(HypervisorClientTest, ReportsAnAbsentHypervisorAtOnce) {
  auto r = call({}, "PATCH", "/vm", R"({"state":"Paused"})", dir_.path() + "/nobody.sock");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error(), Error::kUnavailable);
  EXPECT_NE(r.message().find("cannot reach firecracker API at"), std::string::npos) << r.message();
}

TEST_F(HypervisorClientTest, WaitsForTheSocketOfAFreshVmm) {
  const std::string later = dir_.path() + "/later.sock";
  std::unique_ptr<FakeHypervisor> late;
  uv_timer_t t;
  uv_timer_init(loop_.get(), &t);
  struct Ctx {
    std::unique_ptr<FakeHypervisor>* slot;
    const ApiSpec* spec;
    std::string path;
  } ctx{&late, spec_.get(), later};
  t.data = &ctx;
  uv_timer_start(&t, [](uv_timer_t* h) {
    auto* c = static_cast<Ctx*>(h->data);
    *c->slot = std::make_unique<FakeHypervisor>(*c->spec, c->path);
  }, 60, 0);
  auto r = call({.timeout_ms = 2000, .connect_wait_ms = 1500}, "PUT", "/actions", R"({"action_type":"InstanceStart"})",
                later);
  uv_close(reinterpret_cast<uv_handle_t*>(&t), nullptr);
  loop_.run_until([] { return false; }, 10);  // `t` lives on this stack frame: let its close finish
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(r->status, 204);
}

TEST_F(HypervisorClientTest, DestroyingTheClientCancelsItsCallbacks) {
  fake_->inject("PATCH /vm", FakeHypervisor::Fault::kNoAnswer);
  bool called = false;
  {
    // The request is in flight (sent, unanswered) well before its timeout, even on a slow sanitizer build;
    // after the destroy the loop runs past that timeout, so neither the answer nor the timeout may call back.
    HypervisorClient client(loop_.get(), fake_->socket_path(), "firecracker", {.timeout_ms = 400});
    client.request("PATCH", "/vm", R"({"state":"Paused"})", [&](Result<HypervisorResponse>) { called = true; });
    loop_.run_until([] { return false; }, 20);
  }
  loop_.run_until([] { return false; }, 600);
  EXPECT_FALSE(called);
}

// ---- the typed API against the spec ----

class FirecrackerApiTest : public HypervisorClientTest {
 protected:
  Status run(const std::function<void(FirecrackerApi&, FirecrackerApi::Done)>& op) {
    FirecrackerApi api(loop_.get(), fake_->socket_path(), {.timeout_ms = 2000});
    std::optional<Status> got;
    op(api, [&](Status s) { got = std::move(s); });
    EXPECT_TRUE(loop_.run_until([&] { return got.has_value(); }));
    return got ? *got : Status(fail(Error::kInternal, "no answer"));
  }
};

TEST_F(FirecrackerApiTest, EveryOperationConformsToTheSpec) {
  EXPECT_TRUE(run([](auto& a, auto d) { a.put_machine_config({.vcpu_count = 2, .mem_size_mib = 256, .smt = false,
                                                               .track_dirty_pages = true}, d); }).ok());
  EXPECT_TRUE(run([](auto& a, auto d) { a.put_boot_source({"/k", "console=ttyS0", "/initrd"}, d); }).ok());
  EXPECT_TRUE(run([](auto& a, auto d) { a.put_boot_source({"/k", "", ""}, d); }).ok());
  EXPECT_TRUE(run([](auto& a, auto d) { a.put_drive({"rootfs", "/rootfs.ext4", true, false}, d); }).ok());
  EXPECT_TRUE(run([](auto& a, auto d) { a.put_network_interface({"eth0", "tap0", "06:00:00:00:00:01"}, d); }).ok());
  EXPECT_TRUE(run([](auto& a, auto d) { a.put_vsock({3, "/v.sock"}, d); }).ok());
  EXPECT_TRUE(run([](auto& a, auto d) { a.instance_start(d); }).ok());
  EXPECT_TRUE(run([](auto& a, auto d) { a.pause(d); }).ok());
  EXPECT_TRUE(run([](auto& a, auto d) { a.resume(d); }).ok());
  EXPECT_TRUE(run([](auto& a, auto d) { a.create_snapshot({"/s", "/m", FcSnapshotType::kFull}, d); }).ok());
  EXPECT_TRUE(run([](auto& a, auto d) { a.create_snapshot({"/s", "/m", FcSnapshotType::kDiff}, d); }).ok());
  EXPECT_TRUE(run([](auto& a, auto d) { a.load_snapshot({"/s", FcMemBackend::kFile, "/m", true, false}, d); }).ok());
  EXPECT_TRUE(run([](auto& a, auto d) { a.load_snapshot({"/s", FcMemBackend::kUffd, "/uffd.sock", false, true}, d); }).ok());
  fake_->set_response_fields("GET /", {{"state", "Paused"}});
  std::optional<Result<std::string>> state;
  EXPECT_TRUE(run([&](auto& a, auto d) {
                a.instance_state([&state, d](Result<std::string> r) {
                  state = r;
                  d({});
                });
              }).ok());
  ASSERT_TRUE(state && state->ok());
  EXPECT_EQ(**state, "Paused");

  EXPECT_EQ(joined(fake_->problems()), "");
  EXPECT_EQ(fake_->operations_seen(), kFirecrackerOps);
  // The enum values actually sent, not only accepted.
  std::set<std::string> sent;
  for (const auto& r : fake_->requests()) sent.insert(r.body);
  EXPECT_TRUE(sent.count(R"({"state":"Paused"})"));
  EXPECT_TRUE(sent.count(R"({"state":"Resumed"})"));
  EXPECT_TRUE(sent.count(R"({"action_type":"InstanceStart"})"));
}

TEST_F(FirecrackerApiTest, FaultMessageBecomesTheFailure) {
  fake_->inject("PUT /actions", FakeHypervisor::Fault::kErrorStatus, 400, "Cannot start microvm without kernel");
  Status s = run([](auto& a, auto d) { a.instance_start(d); });
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error(), Error::kInvalidArgument);
  EXPECT_NE(s.message().find("PUT /actions failed (400 Bad Request): Cannot start microvm without kernel"),
            std::string::npos) << s.message();

  // "default" covers every other status: a 500 is the hypervisor's internal error.
  fake_->inject("PUT /snapshot/create", FakeHypervisor::Fault::kErrorStatus, 500, "No space left on device");
  s = run([](auto& a, auto d) { a.create_snapshot({"/s", "/m", FcSnapshotType::kFull}, d); });
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error(), Error::kInternal);
  EXPECT_NE(s.message().find("No space left on device"), std::string::npos) << s.message();
  // The error bodies the fake sent are the spec's Error definition.
  for (const auto& r : fake_->requests()) EXPECT_EQ(r.problems.size(), 0u);
}

TEST_F(FirecrackerApiTest, RejectsAnIdThatIsNoPathSegmentBeforeSending) {
  Status s = run([](auto& a, auto d) { a.put_drive({"../vm", "/r", true, false}, d); });
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error(), Error::kInvalidArgument);
  EXPECT_TRUE(fake_->requests().empty());
}

// ---- the Driver adapter ----

class FirecrackerDriverTest : public HypervisorClientTest {
 protected:
  void SetUp() override {
    HypervisorClientTest::SetUp();
    if (IsSkipped()) return;
    // What Firecracker does on these two besides answering: write / read the files the request names.
    fake_->on_success("PUT /snapshot/create", [](const json& b) {
      std::ofstream(b["snapshot_path"].get<std::string>()) << "vmstate";
      std::ofstream(b["mem_file_path"].get<std::string>()) << "memory";
    });
    config_.binary = testing::write_vmm_script(dir_.path(), fake_->socket_path());
    config_.kernel_image_path = "/boot/vmlinux";
    config_.rootfs_path = "/images/rootfs.ext4";
    config_.tap_device = "tap7";
    config_.api.timeout_ms = 1000;
    config_.spawn_connect_wait_ms = 2000;
    spec_sb_.id = "sb-abcdefghijkl";
    spec_sb_.memory_mb = 256;
    spec_sb_.cpus = 1.5;
    sandbox_dir_ = dir_.path() + "/sb";
  }
  void TearDown() override {
    int pid = testing::read_pid_file(sandbox_dir_ + "/vmm.pid");
    if (pid > 0 && testing::process_alive(pid)) ::kill(pid, SIGKILL);
  }
  std::unique_ptr<Driver> driver() { return make_firecracker_driver(loop_.get(), config_); }
  Result<RuntimeInfo> wait(const std::function<void(Driver::RuntimeDone)>& op) {
    std::optional<Result<RuntimeInfo>> got;
    op([&](Result<RuntimeInfo> r) { got = std::move(r); });
    EXPECT_FALSE(got.has_value()) << "callback ran before the call returned";
    EXPECT_TRUE(loop_.run_until([&] { return got.has_value(); }, 8000));
    return got ? std::move(*got) : Result<RuntimeInfo>(fail(Error::kInternal, "no answer"));
  }
  Status wait_status(const std::function<void(Driver::Done)>& op) {
    std::optional<Status> got;
    op([&](Status s) { got = std::move(s); });
    EXPECT_TRUE(loop_.run_until([&] { return got.has_value(); }, 8000));
    return got ? *got : Status(fail(Error::kInternal, "no answer"));
  }
  std::vector<std::string> sequence() const {
    std::vector<std::string> out;
    for (const auto& r : fake_->requests()) out.push_back(r.op_key);
    return out;
  }
  FirecrackerConfig config_;
  SandboxSpec spec_sb_;
  std::string sandbox_dir_;
};

TEST_F(FirecrackerDriverTest, MissingBinaryIsUnsupported) {
  config_.binary = dir_.path() + "/no-such-firecracker";
  auto d = driver();
  auto r = wait([&](auto done) { d->start(spec_sb_, sandbox_dir_, done); });
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error(), Error::kUnsupported);
  EXPECT_EQ(r.message(), "firecracker binary not found at " + config_.binary);
  EXPECT_TRUE(fake_->requests().empty());
}

TEST_F(FirecrackerDriverTest, FullLifecycleConformsToTheSpec) {
  auto d = driver();
  EXPECT_TRUE(d->capabilities().pause && d->capabilities().hibernate);
  auto info = wait([&](auto done) { d->start(spec_sb_, sandbox_dir_, done); });
  ASSERT_TRUE(info.ok()) << info.message();
  EXPECT_EQ(info->pid, testing::read_pid_file(sandbox_dir_ + "/vmm.pid"));
  EXPECT_TRUE(testing::process_alive(info->pid));
  EXPECT_EQ(::sched_getscheduler(info->pid), SCHED_BATCH) << "node.batch_scheduling is on by default";
  bool exited = false;
  ASSERT_TRUE(d->watch_exit(spec_sb_, *info, [&] { exited = true; }).ok());

  ASSERT_TRUE(wait_status([&](auto done) { d->pause(spec_sb_, *info, done); }).ok());
  fake_->set_response_fields("GET /", {{"state", "Paused"}});
  auto seen = d->observe(spec_sb_, *info);
  EXPECT_TRUE(seen.alive && seen.paused);
  ASSERT_TRUE(wait_status([&](auto done) { d->resume(spec_sb_, *info, done); }).ok());
  ASSERT_TRUE(wait_status([&](auto done) { d->pause(spec_sb_, *info, done); }).ok());

  auto saved = wait([&](auto done) { d->hibernate(spec_sb_, *info, done); });
  ASSERT_TRUE(saved.ok()) << saved.message();
  EXPECT_EQ(saved->pid, 0);
  EXPECT_FALSE(testing::process_alive(info->pid)) << "hibernate must end the VMM so its memory is freed";
  EXPECT_TRUE(std::filesystem::exists(sandbox_dir_ + "/saved-state/vmstate"));
  EXPECT_FALSE(exited) << "the exit hibernate causes is not reported to the watcher";
  EXPECT_TRUE(d->observe(spec_sb_, *saved).hibernated);

  auto restored = wait([&](auto done) { d->restore(spec_sb_, *saved, done); });
  ASSERT_TRUE(restored.ok()) << restored.message();
  EXPECT_TRUE(testing::process_alive(restored->pid));
  EXPECT_NE(restored->pid, info->pid);
  ASSERT_TRUE(wait_status([&](auto done) { d->terminate(spec_sb_, *restored, done); }).ok());
  EXPECT_FALSE(testing::process_alive(restored->pid));

  EXPECT_EQ(joined(fake_->problems()), "");
  std::vector<std::string> expected = {
      "PUT /machine-config", "PUT /boot-source", "PUT /drives/{drive_id}", "PUT /network-interfaces/{iface_id}",
      "PUT /vsock",          "PUT /actions",     "PATCH /vm",              "GET /",
      "PATCH /vm",           "PATCH /vm",        "PATCH /vm",              "PUT /snapshot/create",
      "PUT /snapshot/load"};
  EXPECT_EQ(sequence(), expected);
  auto reqs = fake_->requests();
  EXPECT_EQ(json::parse(reqs[0].body), json::parse(R"({"vcpu_count":2,"mem_size_mib":256,"smt":false,"track_dirty_pages":false})"));
  EXPECT_EQ(json::parse(reqs.back().body)["resume_vm"], true);
  EXPECT_EQ(json::parse(reqs.back().body)["mem_backend"]["backend_type"], "File");
}

TEST_F(FirecrackerDriverTest, AgentPathGoesThroughTheVsockTheVmmWasGiven) {
  auto d = driver();
  auto info = wait([&](auto done) { d->start(spec_sb_, sandbox_dir_, done); });
  ASSERT_TRUE(info.ok()) << info.message();
  std::string uds_path;
  for (const auto& r : fake_->requests())
    if (r.op_key == "PUT /vsock") uds_path = json::parse(r.body).value("uds_path", "");
  // Relative to the VMM's directory, the sandbox's: a sandbox started from a memory snapshot binds its own.
  EXPECT_EQ(uds_path, "vsock.sock");
  testing::expect_agent_path_over_vsock(*d, spec_sb_, *info, sandbox_dir_ + "/" + uds_path);
  ASSERT_TRUE(wait_status([&](auto done) { d->terminate(spec_sb_, *info, done); }).ok());
}

// A memory checkpoint pauses the VM for a full snapshot into the node's directory and resumes it; a start
// from that directory loads it (memory file backend, resumed) in a VMM of its own, with no boot.
TEST_F(FirecrackerDriverTest, AMemoryCheckpointResumesTheVmAndAStartFromItLoadsIt) {
  auto d = driver();
  EXPECT_TRUE(d->capabilities().memory_checkpoint);
  auto info = wait([&](auto done) { d->start(spec_sb_, sandbox_dir_, done); });
  ASSERT_TRUE(info.ok()) << info.message();
  const std::string snap = dir_.path() + "/snap.d";
  std::filesystem::create_directories(snap);
  auto saved = testing::checkpoint_memory(*d, loop_, spec_sb_, *info, snap);
  ASSERT_TRUE(saved.ok()) << saved.message();
  EXPECT_EQ(saved->state_bytes, 7u);  // "vmstate"
  EXPECT_GT(saved->ram_bytes, 0u);
  EXPECT_TRUE(testing::process_alive(info->pid)) << "the source goes on";
  const size_t after_checkpoint = fake_->requests().size();

  const SandboxSpec fork = testing::from_memory_snapshot(spec_sb_, snap);
  const std::string fork_dir = dir_.path() + "/fork";
  auto started = wait([&](auto done) { d->start(fork, fork_dir, done); });
  ASSERT_TRUE(started.ok()) << started.message();
  EXPECT_EQ(started->driver_data["vsock_socket"], fork_dir + "/vsock.sock");

  // A failed snapshot resumes the VM all the same, and says why.
  fake_->inject("PUT /snapshot/create", FakeHypervisor::Fault::kErrorStatus, 400, "No space left on device");
  auto refused = testing::checkpoint_memory(*d, loop_, spec_sb_, *info, snap);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("No space left on device"), std::string::npos) << refused.message();

  EXPECT_EQ(joined(fake_->problems()), "");
  std::vector<std::string> seq = sequence();
  seq.erase(seq.begin(), seq.begin() + static_cast<std::ptrdiff_t>(after_checkpoint) - 3);
  EXPECT_EQ(seq, (std::vector<std::string>{"PATCH /vm", "PUT /snapshot/create", "PATCH /vm", "PUT /snapshot/load",
                                           "PATCH /vm", "PUT /snapshot/create", "PATCH /vm"}));
  auto reqs = fake_->requests();
  EXPECT_EQ(json::parse(reqs[after_checkpoint - 3].body), json::parse(R"({"state":"Paused"})"));
  EXPECT_EQ(json::parse(reqs[after_checkpoint - 1].body), json::parse(R"({"state":"Resumed"})"));
  auto load = json::parse(reqs[after_checkpoint].body);
  EXPECT_EQ(load["snapshot_path"], snap + "/vmstate");
  EXPECT_EQ(load["mem_backend"], json::parse(R"({"backend_type":"File","backend_path":")" + snap + R"(/memory"})"));
  EXPECT_EQ(load["resume_vm"], true);
  EXPECT_EQ(json::parse(reqs.back().body), json::parse(R"({"state":"Resumed"})"));
  ASSERT_TRUE(wait_status([&](auto done) { d->terminate(fork, *started, done); }).ok());
  ASSERT_TRUE(wait_status([&](auto done) { d->terminate(spec_sb_, *info, done); }).ok());
}

// A VM suspended in memory is snapshotted as it stands: no pause and no resume of the driver's own.
TEST_F(FirecrackerDriverTest, AMemoryCheckpointOfAPausedVmNeitherPausesNorResumesIt) {
  auto d = driver();
  auto info = wait([&](auto done) { d->start(spec_sb_, sandbox_dir_, done); });
  ASSERT_TRUE(info.ok()) << info.message();
  ASSERT_TRUE(wait_status([&](auto done) { d->pause(spec_sb_, *info, done); }).ok());
  const size_t before = fake_->requests().size();
  const std::string snap = dir_.path() + "/snap.d";
  std::filesystem::create_directories(snap);
  auto saved = testing::checkpoint_memory(*d, loop_, spec_sb_, *info, snap, CheckpointFrom::kPaused);
  ASSERT_TRUE(saved.ok()) << saved.message();
  EXPECT_EQ(saved->pause_ms, 0);
  std::vector<std::string> seq = sequence();
  seq.erase(seq.begin(), seq.begin() + static_cast<std::ptrdiff_t>(before));
  EXPECT_EQ(seq, (std::vector<std::string>{"PUT /snapshot/create"}));
  // A hibernated one is refused with the way out (its saved state is not copied yet).
  auto hibernated = testing::checkpoint_memory(*d, loop_, spec_sb_, *info, snap, CheckpointFrom::kHibernated);
  ASSERT_FALSE(hibernated.ok());
  EXPECT_EQ(hibernated.error(), Error::kConflict);
  EXPECT_NE(hibernated.message().find("resume it first"), std::string::npos) << hibernated.message();
  ASSERT_TRUE(wait_status([&](auto done) { d->terminate(spec_sb_, *info, done); }).ok());
}

TEST_F(FirecrackerDriverTest, BootFailureLeavesNothingRunning) {
  fake_->inject("PUT /actions", FakeHypervisor::Fault::kErrorStatus, 400, "Invalid kernel image");
  auto d = driver();
  auto r = wait([&](auto done) { d->start(spec_sb_, sandbox_dir_, done); });
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("Invalid kernel image"), std::string::npos) << r.message();
  EXPECT_FALSE(testing::process_alive(testing::read_pid_file(sandbox_dir_ + "/vmm.pid")));
}

TEST_F(FirecrackerDriverTest, PauseFailureAndTimeoutLeaveItRunning) {
  auto d = driver();
  auto info = wait([&](auto done) { d->start(spec_sb_, sandbox_dir_, done); });
  ASSERT_TRUE(info.ok()) << info.message();
  fake_->inject("PATCH /vm", FakeHypervisor::Fault::kErrorStatus, 400, "vCPUs are stuck");
  Status s = wait_status([&](auto done) { d->pause(spec_sb_, *info, done); });
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("vCPUs are stuck"), std::string::npos);
  fake_->inject("PATCH /vm", FakeHypervisor::Fault::kNoAnswer);
  s = wait_status([&](auto done) { d->pause(spec_sb_, *info, done); });
  EXPECT_EQ(s.error(), Error::kTimeout);
  EXPECT_TRUE(testing::process_alive(info->pid));
  EXPECT_EQ(joined(fake_->problems()), "");
}

TEST_F(FirecrackerDriverTest, SnapshotFailureKeepsItPausedAndEarlierStateIntact) {
  auto d = driver();
  auto info = wait([&](auto done) { d->start(spec_sb_, sandbox_dir_, done); });
  ASSERT_TRUE(info.ok()) << info.message();
  std::filesystem::create_directories(sandbox_dir_ + "/saved-state");
  std::ofstream(sandbox_dir_ + "/saved-state/vmstate") << "earlier";
  fake_->inject("PUT /snapshot/create", FakeHypervisor::Fault::kErrorStatus, 400, "No space left on device");
  auto r = wait([&](auto done) { d->hibernate(spec_sb_, *info, done); });
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("No space left on device"), std::string::npos);
  EXPECT_TRUE(testing::process_alive(info->pid)) << "still paused in memory";
  EXPECT_FALSE(std::filesystem::exists(sandbox_dir_ + "/saved-state.new"));
  std::ifstream earlier(sandbox_dir_ + "/saved-state/vmstate");
  std::string content;
  earlier >> content;
  EXPECT_EQ(content, "earlier");
}

TEST_F(FirecrackerDriverTest, CancelledHibernateStaysInMemory) {
  auto d = driver();
  auto info = wait([&](auto done) { d->start(spec_sb_, sandbox_dir_, done); });
  ASSERT_TRUE(info.ok()) << info.message();
  EXPECT_FALSE(d->cancel(spec_sb_)) << "nothing in flight";
  std::optional<Result<RuntimeInfo>> got;
  d->hibernate(spec_sb_, *info, [&](Result<RuntimeInfo> r) { got = std::move(r); });
  EXPECT_TRUE(d->cancel(spec_sb_));
  ASSERT_TRUE(loop_.run_until([&] { return got.has_value(); }));
  ASSERT_FALSE(got->ok());
  EXPECT_EQ(got->error(), Error::kConflict);
  EXPECT_TRUE(testing::process_alive(info->pid));
}

TEST_F(FirecrackerDriverTest, RestoreFailureKeepsTheSavedState) {
  auto d = driver();
  auto info = wait([&](auto done) { d->start(spec_sb_, sandbox_dir_, done); });
  ASSERT_TRUE(info.ok()) << info.message();
  auto saved = wait([&](auto done) { d->hibernate(spec_sb_, *info, done); });
  ASSERT_TRUE(saved.ok()) << saved.message();
  fake_->inject("PUT /snapshot/load", FakeHypervisor::Fault::kErrorStatus, 400, "Snapshot version mismatch");
  auto r = wait([&](auto done) { d->restore(spec_sb_, *saved, done); });
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("Snapshot version mismatch"), std::string::npos);
  EXPECT_FALSE(testing::process_alive(testing::read_pid_file(sandbox_dir_ + "/vmm.pid")));
  EXPECT_TRUE(std::filesystem::exists(sandbox_dir_ + "/saved-state/vmstate"));
  EXPECT_TRUE(d->observe(spec_sb_, *saved).hibernated);
}

TEST_F(FirecrackerDriverTest, ReportsAVmmThatDies) {
  auto d = driver();
  auto info = wait([&](auto done) { d->start(spec_sb_, sandbox_dir_, done); });
  ASSERT_TRUE(info.ok()) << info.message();
  bool exited = false;
  ASSERT_TRUE(d->watch_exit(spec_sb_, *info, [&] { exited = true; }).ok());
  ::kill(info->pid, SIGKILL);
  EXPECT_TRUE(loop_.run_until([&] { return exited; }));
  EXPECT_FALSE(d->observe(spec_sb_, *info).alive);
}

}  // namespace
}  // namespace sg
