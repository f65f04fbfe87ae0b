#include "noderuntime/create_spec.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "tests/unit/node/fake_driver.h"

namespace sg {
namespace {

class CreateSpecTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(uv_loop_init(&loop_), 0);
    drivers_.push_back(std::make_unique<testing::FakeDriver>(&loop_));
    config_.node.default_timeout_secs = 120;
    config_.node.default_pids_max = 256;
  }
  void TearDown() override {
    drivers_.clear();
    uv_run(&loop_, UV_RUN_DEFAULT);
    EXPECT_EQ(uv_loop_close(&loop_), 0);
  }
  CreateRequest request() {
    CreateRequest r;
    r.name = "web";
    r.command = {"python3", "-m", "http.server"};
    return r;
  }
  Result<SandboxSpec> make(const CreateRequest& r) { return make_sandbox_spec(r, CreateContext{config_, drivers_}); }
  std::string refusal(const CreateRequest& r) {
    auto spec = make(r);
    EXPECT_FALSE(spec) << "accepted";
    if (spec) return "";
    EXPECT_EQ(spec.error(), Error::kInvalidArgument) << spec.message();
    return spec.message();
  }

  uv_loop_t loop_{};
  Config config_;
  std::vector<std::unique_ptr<Driver>> drivers_;
};

TEST_F(CreateSpecTest, WhatTheRequestLeavesOutComesFromTheConfigAndTheDefaultDriver) {
  auto spec = make(request());
  ASSERT_TRUE(spec) << spec.message();
  EXPECT_EQ(spec->name, "web");
  EXPECT_EQ(spec->timeout_secs, 120u);
  EXPECT_EQ(spec->pids_max, 256u);
  EXPECT_EQ(spec->driver, "fake");
  EXPECT_EQ(spec->agent_port, config_.agent_port);
  EXPECT_EQ(spec->image, config_.node.default_image);  // recorded as given: no image store here
  EXPECT_TRUE(spec->id.empty());                         // the node assigns id, token and uid range
  EXPECT_TRUE(spec->token_sha256.empty());
}

TEST_F(CreateSpecTest, EachBadFieldIsRefusedByName) {
  CreateRequest r = request();
  r.command.clear();
  EXPECT_EQ(refusal(r), "command: needs at least one element (the program to run)");
  r = request();
  r.env["1BAD"] = "x";
  EXPECT_EQ(refusal(r), "env: key '1BAD' is not a valid variable name ([A-Za-z_][A-Za-z0-9_]*)");
  r = request();
  r.env["OK"] = std::string("a\0b", 3);
  EXPECT_EQ(refusal(r), "env.OK: must not contain NUL bytes");
  r = request();
  r.cwd = "relative";
  EXPECT_EQ(refusal(r), "cwd: must be an absolute path");
  r = request();
  r.exposed_ports = {8080, 8080};
  EXPECT_EQ(refusal(r), "exposed_ports: 8080 is listed twice");
  r = request();
  r.exposed_ports = {config_.agent_port};
  EXPECT_NE(refusal(r).find("is the agent's port"), std::string::npos);
  r = request();
  r.timeout_secs = 0;
  EXPECT_NE(refusal(r).find("timeout_secs: must be between 1 and"), std::string::npos);
  r = request();
  r.memory_mb = 15;
  EXPECT_EQ(refusal(r), "memory_mb: must be between 16 and 1048576");
  r = request();
  r.cpus = 0;
  EXPECT_EQ(refusal(r), "cpus: must be > 0 and <= 1024");
  r = request();
  r.driver = "firecracker";
  EXPECT_EQ(refusal(r), "driver: 'firecracker' is not enabled on this node (enabled: fake)");
  r = request();
  r.name = "Not A Name";
  auto bad_name = make(r);
  ASSERT_FALSE(bad_name);
  EXPECT_EQ(bad_name.error(), Error::kInvalidArgument);
}

TEST_F(CreateSpecTest, ThePortLimitIsExplicit) {
  CreateRequest r = request();
  for (int64_t p = 1; p <= static_cast<int64_t>(kMaxExposedPorts); ++p) r.exposed_ports.push_back(10000 + p);
  ASSERT_TRUE(make(r));
  r.exposed_ports.push_back(20000);
  EXPECT_EQ(refusal(r), "exposed_ports + ports: at most 64 ports, got 65");
}

TEST_F(CreateSpecTest, ACreateFromASnapshotNeedsASnapshotStore) {
  CreateRequest r = request();
  r.snapshot_id = "snap-0123456789abcdef";
  auto spec = make(r);
  ASSERT_FALSE(spec);
  EXPECT_EQ(spec.error(), Error::kUnavailable);
  EXPECT_EQ(spec.message(), "this node has no snapshot store");
}

}  // namespace
}  // namespace sg
