// Contract tests of the Cloud Hypervisor driver against ../shared/specs/cloud-hypervisor.yaml (served by a
// fake, not a running Cloud Hypervisor), and the validator on that OpenAPI 3 spec.
#include "noderuntime/cloud_hypervisor_driver.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>

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

const std::set<std::string> kCloudHypervisorOps = {
    "PUT /vm.create", "PUT /vm.boot",    "PUT /vm.pause",    "PUT /vm.resume",
    "PUT /vm.snapshot", "PUT /vm.restore", "PUT /vm.shutdown", "GET /vm.info"};

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

class SpecCloudHypervisor : public ::testing::Test {
 protected:
  void SetUp() override {
    spec_ = testing::load_spec("cloud-hypervisor.yaml");
    if (!spec_) GTEST_SKIP() << "../shared/specs missing: Cloud Hypervisor driver NOT verified against its spec";
  }
  std::vector<std::string> check(const std::string& method, const std::string& target, const std::string& body) {
    std::string ct = "application/json";
    return spec_->check_request(method, target, body.empty() ? nullptr : &ct, body).problems;
  }
  std::unique_ptr<ApiSpec> spec_;
};

TEST_F(SpecCloudHypervisor, DefinesEveryOperationTheDriverUsesUnderItsBasePath) {
  EXPECT_EQ(spec_->base_path(), "/api/v1");
  auto ops = spec_->operations();
  for (const auto& op : kCloudHypervisorOps) EXPECT_TRUE(ops.count(op)) << op;
  EXPECT_TRUE(mentions(check("PUT", "/vm.boot", ""), "outside the base path"));
  EXPECT_EQ(joined(check("PUT", "/api/v1/vm.boot", "")), "");
}

TEST_F(SpecCloudHypervisor, CatchesBadVmConfigs) {
  const std::string good = R"({"payload":{"kernel":"/k"},"cpus":{"boot_vcpus":1,"max_vcpus":1},"memory":{"size":1}})";
  EXPECT_EQ(joined(check("PUT", "/api/v1/vm.create", good)), "");
  EXPECT_TRUE(mentions(check("PUT", "/api/v1/vm.create", R"({"cpus":{"boot_vcpus":1,"max_vcpus":1}})"),
                       "required field 'payload' is missing"));
  EXPECT_TRUE(mentions(check("PUT", "/api/v1/vm.create", R"({"payload":{"kernel":"/k"},"cpus":{"boot_vcpus":1}})"),
                       "body.cpus: required field 'max_vcpus' is missing"));
  EXPECT_TRUE(mentions(check("PUT", "/api/v1/vm.create", R"({"payload":{"kernel":"/k"},"console":{"mode":"Serial"}})"),
                       "body.console.mode"));
  EXPECT_TRUE(mentions(check("PUT", "/api/v1/vm.create", R"({"payload":{"kernel":"/k"},"memory":{"size":"1G"}})"),
                       "expected integer"));
  EXPECT_TRUE(mentions(check("PUT", "/api/v1/vm.create", R"({"payload":{"kernel":"/k"},"disks":[{"readonly":true}]})"),
                       "body.disks[0]: required field 'path' is missing"));
  EXPECT_TRUE(mentions(check("PUT", "/api/v1/vm.create", R"({"payload":{"kernel":"/k"},"vsock":{"cid":2,"socket":"/v"}})"),
                       "below the minimum"));
  EXPECT_TRUE(mentions(check("PUT", "/api/v1/vm.create", R"({"payload":{"kernel":"/k","cmd_line":"x"}})"),
                       "unknown field 'cmd_line'"));
}

TEST_F(SpecCloudHypervisor, KnowsWhichResponsesExist) {
  EXPECT_EQ(spec_->success_status("PUT /vm.boot"), 204);
  EXPECT_TRUE(spec_->defines_status("PUT /vm.boot", 404));
  EXPECT_FALSE(spec_->defines_status("PUT /vm.boot", 405)) << "so the fake refuses to inject it";
  EXPECT_FALSE(spec_->response_schema("PUT /vm.pause", 405).IsDefined()) << "no error body is specified";
  auto fc = testing::load_spec("firecracker.yaml");
  EXPECT_TRUE(fc->defines_status("PUT /actions", 500)) << "through \"default\"";
  EXPECT_TRUE(fc->response_schema("PATCH /vm", 400).IsDefined());
}

TEST_F(SpecCloudHypervisor, CatchesBodiesAndMethodsTheSpecDoesNotHave) {
  EXPECT_TRUE(mentions(check("PUT", "/api/v1/vm.pause", R"({"now":true})"), "takes no request body"));
  EXPECT_TRUE(mentions(check("POST", "/api/v1/vm.pause", ""), "method POST is not defined"));
  EXPECT_TRUE(mentions(check("PUT", "/api/v1/vm.restore", R"({"prefault":true})"), "'source_url' is missing"));
  EXPECT_TRUE(mentions(check("PUT", "/api/v1/vm.restore", ""), "request body is required"));
  EXPECT_TRUE(mentions(check("PUT", "/api/v1/vm.snapshot", R"({"destination":"file:///x"})"), "unknown field"));
}

class CloudHypervisorTest : public SpecCloudHypervisor {
 protected:
  void SetUp() override {
    SpecCloudHypervisor::SetUp();
    if (IsSkipped()) return;
    fake_ = std::make_unique<FakeHypervisor>(*spec_, dir_.path() + "/api.sock");
    // What Cloud Hypervisor does besides answering vm.snapshot: write the state into the destination dir.
    fake_->on_success("PUT /vm.snapshot", [](const json& b) {
      std::string url = b["destination_url"].get<std::string>();
      std::ofstream(url.substr(std::string("file://").size()) + "/state.json") << "{}";
    });
    config_.binary = testing::write_vmm_script(dir_.path(), fake_->socket_path());
    config_.kernel = "/boot/vmlinux";
    config_.rootfs = "/images/rootfs.raw";
    config_.tap = "tap3";
    config_.api.timeout_ms = 1000;
    spec_sb_.id = "sb-mnopqrstuvwx";
    spec_sb_.memory_mb = 256;
    spec_sb_.cpus = 2;
    sandbox_dir_ = dir_.path() + "/sb";
  }
  void TearDown() override {
    int pid = testing::read_pid_file(sandbox_dir_ + "/vmm.pid");
    if (pid > 0 && testing::process_alive(pid)) ::kill(pid, SIGKILL);
  }
  Status api_call(const std::function<void(CloudHypervisorApi&, CloudHypervisorApi::Done)>& op) {
    CloudHypervisorApi api(loop_.get(), fake_->socket_path(), {.timeout_ms = 2000});
    std::optional<Status> got;
    op(api, [&](Status s) { got = std::move(s); });
    EXPECT_TRUE(loop_.run_until([&] { return got.has_value(); }));
    return got ? *got : Status(fail(Error::kInternal, "no answer"));
  }
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
  TempDir dir_;
  TestLoop loop_;
  std::unique_ptr<FakeHypervisor> fake_;
  CloudHypervisorConfig config_;
  SandboxSpec spec_sb_;
  std::string sandbox_dir_;
};

TEST_F(CloudHypervisorTest, EveryApiOperationConformsToTheSpec) {
  ChVmConfig vm{.vcpus = 2, .memory_bytes = 256ull << 20, .kernel = "/k", .cmdline = "console=ttyS0",
                .initramfs = "/initrd", .rootfs = "/r", .tap = "tap0", .vsock_cid = 3, .vsock_socket = "/v",
                .serial_file = "/serial.log"};
  EXPECT_TRUE(api_call([&](auto& a, auto d) { a.create(vm, d); }).ok());
  EXPECT_TRUE(api_call([](auto& a, auto d) { ChVmConfig minimal;  // only the required payload.kernel and the fixed devices
    minimal.kernel = "/k";
    minimal.cmdline.clear();
    a.create(minimal, d); }).ok());
  EXPECT_TRUE(api_call([](auto& a, auto d) { a.boot(d); }).ok());
  EXPECT_TRUE(api_call([](auto& a, auto d) { a.pause(d); }).ok());
  EXPECT_TRUE(api_call([](auto& a, auto d) { a.snapshot("file:///tmp/nowhere", d); }).ok());
  EXPECT_TRUE(api_call([](auto& a, auto d) { a.resume(d); }).ok());
  EXPECT_TRUE(api_call([](auto& a, auto d) { a.restore("file:///tmp/nowhere", true, d); }).ok());
  EXPECT_TRUE(api_call([](auto& a, auto d) { a.shutdown(d); }).ok());
  fake_->set_response_fields("GET /vm.info", {{"state", "Paused"}});
  std::optional<Result<std::string>> state;
  EXPECT_TRUE(api_call([&](auto& a, auto d) {
                a.state([&state, d](Result<std::string> r) {
                  state = r;
                  d({});
                });
              }).ok());
  ASSERT_TRUE(state && state->ok());
  EXPECT_EQ(**state, "Paused");
  EXPECT_EQ(joined(fake_->problems()), "");
  EXPECT_EQ(fake_->operations_seen(), kCloudHypervisorOps);
}

TEST_F(CloudHypervisorTest, ErrorStatusesMapToFailuresWithTheHypervisorsText) {
  fake_->inject("PUT /vm.pause", FakeHypervisor::Fault::kErrorStatus, 405, "VM is not running");
  Status s = api_call([](auto& a, auto d) { a.pause(d); });
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error(), Error::kConflict);
  EXPECT_NE(s.message().find("PUT /api/v1/vm.pause failed (405 Method Not Allowed): VM is not running"),
            std::string::npos) << s.message();
  fake_->inject("PUT /vm.boot", FakeHypervisor::Fault::kErrorStatus, 404, "VM is not created");
  s = api_call([](auto& a, auto d) { a.boot(d); });
  EXPECT_EQ(s.error(), Error::kConflict);
  fake_->inject("PUT /vm.restore", FakeHypervisor::Fault::kNoAnswer);
  CloudHypervisorApi api(loop_.get(), fake_->socket_path(), {.timeout_ms = 100});
  std::optional<Status> got;
  api.restore("file:///x", false, [&](Status st) { got = st; });
  ASSERT_TRUE(loop_.run_until([&] { return got.has_value(); }));
  EXPECT_EQ(got->error(), Error::kTimeout);
}

TEST_F(CloudHypervisorTest, MissingBinaryIsUnsupported) {
  config_.binary = dir_.path() + "/no-such-cloud-hypervisor";
  auto d = make_cloud_hypervisor_driver(loop_.get(), config_);
  auto r = wait([&](auto done) { d->start(spec_sb_, sandbox_dir_, done); });
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error(), Error::kUnsupported);
  EXPECT_EQ(r.message(), "cloud-hypervisor binary not found at " + config_.binary);
}

TEST_F(CloudHypervisorTest, FullLifecycleConformsToTheSpec) {
  auto d = make_cloud_hypervisor_driver(loop_.get(), config_);
  auto info = wait([&](auto done) { d->start(spec_sb_, sandbox_dir_, done); });
  ASSERT_TRUE(info.ok()) << info.message();
  EXPECT_TRUE(testing::process_alive(info->pid));
  EXPECT_EQ(::sched_getscheduler(info->pid), SCHED_BATCH) << "node.batch_scheduling is on by default";
  ASSERT_TRUE(wait_status([&](auto done) { d->pause(spec_sb_, *info, done); }).ok());
  ASSERT_TRUE(wait_status([&](auto done) { d->resume(spec_sb_, *info, done); }).ok());
  ASSERT_TRUE(wait_status([&](auto done) { d->pause(spec_sb_, *info, done); }).ok());
  auto saved = wait([&](auto done) { d->hibernate(spec_sb_, *info, done); });
  ASSERT_TRUE(saved.ok()) << saved.message();
  EXPECT_FALSE(testing::process_alive(info->pid));
  EXPECT_TRUE(std::filesystem::exists(sandbox_dir_ + "/saved-state/state.json"));
  auto restored = wait([&](auto done) { d->restore(spec_sb_, *saved, done); });
  ASSERT_TRUE(restored.ok()) << restored.message();
  EXPECT_TRUE(testing::process_alive(restored->pid));
  ASSERT_TRUE(wait_status([&](auto done) { d->terminate(spec_sb_, *restored, done); }).ok());
  EXPECT_FALSE(testing::process_alive(restored->pid));

  EXPECT_EQ(joined(fake_->problems()), "");
  std::vector<std::string> seq;
  for (const auto& r : fake_->requests()) seq.push_back(r.op_key);
  std::vector<std::string> expected = {"PUT /vm.create", "PUT /vm.boot",     "PUT /vm.pause",   "PUT /vm.resume",
                                       "PUT /vm.pause",  "PUT /vm.pause",    "PUT /vm.snapshot", "PUT /vm.restore",
                                       "PUT /vm.resume", "PUT /vm.shutdown"};
  EXPECT_EQ(seq, expected);
  auto create = json::parse(fake_->requests()[0].body);
  EXPECT_EQ(create["memory"]["size"], 256ull << 20);
  EXPECT_EQ(create["cpus"]["boot_vcpus"], 2);
  EXPECT_EQ(fake_->requests()[6].body, R"({"destination_url":"file://)" + sandbox_dir_ + R"(/saved-state.new"})");
}

TEST_F(CloudHypervisorTest, AgentPathGoesThroughTheVsockTheVmmWasGiven) {
  auto d = make_cloud_hypervisor_driver(loop_.get(), config_);
  auto info = wait([&](auto done) { d->start(spec_sb_, sandbox_dir_, done); });
  ASSERT_TRUE(info.ok()) << info.message();
  auto create = json::parse(fake_->requests().at(0).body);
  // Relative to the VMM's directory, the sandbox's: a sandbox restored from a memory snapshot binds its own.
  EXPECT_EQ(create["vsock"].value("socket", ""), "vsock.sock");
  EXPECT_EQ(create["serial"].value("file", ""), "serial.log");
  testing::expect_agent_path_over_vsock(*d, spec_sb_, *info, sandbox_dir_ + "/vsock.sock");
  ASSERT_TRUE(wait_status([&](auto done) { d->terminate(spec_sb_, *info, done); }).ok());
}

// A memory checkpoint pauses the VM for vm.snapshot into the node's directory and resumes it; a start from
// that directory is vm.restore + vm.resume in a VMM of its own, with no vm.create.
TEST_F(CloudHypervisorTest, AMemoryCheckpointResumesTheVmAndAStartFromItRestoresIt) {
  fake_->on_success("PUT /vm.snapshot", [](const json& b) {
    const std::string dir = b["destination_url"].get<std::string>().substr(std::string("file://").size());
    std::ofstream(dir + "/config.json") << "{}";
    std::ofstream(dir + "/state.json") << "{\"devices\": []}";
    std::ofstream(dir + "/memory-ranges") << std::string(8192, 'm');
  });
  auto d = make_cloud_hypervisor_driver(loop_.get(), config_);
  EXPECT_TRUE(d->capabilities().memory_checkpoint);
  auto info = wait([&](auto done) { d->start(spec_sb_, sandbox_dir_, done); });
  ASSERT_TRUE(info.ok()) << info.message();
  const std::string snap = dir_.path() + "/snap.d";
  std::filesystem::create_directories(snap);
  auto saved = testing::checkpoint_memory(*d, loop_, spec_sb_, *info, snap);
  ASSERT_TRUE(saved.ok()) << saved.message();
  EXPECT_EQ(saved->state_bytes, 2u + 15u);
  EXPECT_GE(saved->ram_bytes, 8192u);
  EXPECT_TRUE(testing::process_alive(info->pid)) << "the source goes on";

  const SandboxSpec fork = testing::from_memory_snapshot(spec_sb_, snap);
  const std::string fork_dir = dir_.path() + "/fork";
  auto started = wait([&](auto done) { d->start(fork, fork_dir, done); });
  ASSERT_TRUE(started.ok()) << started.message();
  EXPECT_EQ(started->driver_data["vsock_socket"], fork_dir + "/vsock.sock");

  // A failed snapshot resumes the VM all the same, and says why.
  fake_->inject("PUT /vm.snapshot", FakeHypervisor::Fault::kErrorStatus, 405, "No space left on device");
  auto refused = testing::checkpoint_memory(*d, loop_, spec_sb_, *info, snap);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("No space left on device"), std::string::npos) << refused.message();

  EXPECT_EQ(joined(fake_->problems()), "");
  std::vector<std::string> seq;
  for (const auto& r : fake_->requests()) seq.push_back(r.op_key);
  EXPECT_EQ(seq, (std::vector<std::string>{"PUT /vm.create", "PUT /vm.boot", "PUT /vm.pause", "PUT /vm.snapshot",
                                           "PUT /vm.resume", "PUT /vm.restore", "PUT /vm.resume", "PUT /vm.pause",
                                           "PUT /vm.snapshot", "PUT /vm.resume"}));
  EXPECT_EQ(json::parse(fake_->requests()[5].body), json::parse(R"({"source_url":"file://)" + snap + R"(","prefault":false})"));
  ASSERT_TRUE(wait_status([&](auto done) { d->terminate(fork, *started, done); }).ok());
  ASSERT_TRUE(wait_status([&](auto done) { d->terminate(spec_sb_, *info, done); }).ok());
}

TEST_F(CloudHypervisorTest, BootAndRestoreFailuresLeaveNothingRunning) {
  auto d = make_cloud_hypervisor_driver(loop_.get(), config_);
  fake_->inject("PUT /vm.boot", FakeHypervisor::Fault::kErrorStatus, 404, "VM is not created");
  auto r = wait([&](auto done) { d->start(spec_sb_, sandbox_dir_, done); });
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("VM is not created"), std::string::npos);
  EXPECT_FALSE(testing::process_alive(testing::read_pid_file(sandbox_dir_ + "/vmm.pid")));

  auto info = wait([&](auto done) { d->start(spec_sb_, sandbox_dir_, done); });
  ASSERT_TRUE(info.ok()) << info.message();
  auto saved = wait([&](auto done) { d->hibernate(spec_sb_, *info, done); });
  ASSERT_TRUE(saved.ok()) << saved.message();
  fake_->inject("PUT /vm.restore", FakeHypervisor::Fault::kCloseMidResponse);
  auto back = wait([&](auto done) { d->restore(spec_sb_, *saved, done); });
  ASSERT_FALSE(back.ok());
  EXPECT_EQ(back.error(), Error::kUnavailable);
  EXPECT_FALSE(testing::process_alive(testing::read_pid_file(sandbox_dir_ + "/vmm.pid")));
  EXPECT_TRUE(std::filesystem::exists(sandbox_dir_ + "/saved-state/state.json"));
  EXPECT_EQ(joined(fake_->problems()), "");
}

}  // namespace
}  // namespace sg
