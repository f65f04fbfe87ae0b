#include "noderuntime/snapshot_defaults.h"

#include <gtest/gtest.h>

namespace sg {
namespace {

snapshot::Snapshot sample() {
  SandboxSpec spec;
  spec.id = "sb-aaaaaaaaaaaa";
  spec.name = "src";
  spec.driver = "process";
  spec.image = "debian";
  spec.command = {"/bin/sleep", "3600"};
  spec.env = {{"MODE", "prod"}, {"PATH", "/bin"}};
  spec.cwd = "/srv";
  spec.exposed_ports = {8080, 22};
  spec.ports = {{8080, false, PortProtocol::kHttp1}, {22, true, PortProtocol::kTcp}};
  snapshot::Snapshot snap = snapshot_record(spec);
  snap.id = "snap-aaaaaaaaaaaa";
  return snap;
}

TEST(SnapshotDefaults, TheRecordTakesTheSourcesCreateSettings) {
  snapshot::Snapshot snap = sample();
  EXPECT_EQ(snap.type, "filesystem");
  EXPECT_EQ(snap.source_id, "sb-aaaaaaaaaaaa");
  EXPECT_EQ(snap.source_name, "src");
  EXPECT_EQ(snap.image, "debian");
  EXPECT_EQ(snap.command, (std::vector<std::string>{"/bin/sleep", "3600"}));
  EXPECT_EQ(snap.cwd, "/srv");
  ASSERT_EQ(snap.ports.size(), 2u);
  EXPECT_EQ(snap.ports[1].port, 22);
  EXPECT_TRUE(snap.ports[1].is_public);
  EXPECT_EQ(snap.ports[1].protocol, "tcp");
}

TEST(SnapshotDefaults, WhatTheRequestLeavesOutComesFromTheSnapshot) {
  CreateRequest req;
  req.snapshot_id = "snap-aaaaaaaaaaaa";
  req.env = {{"MODE", "test"}};
  req.memory_mb = 256;
  ASSERT_TRUE(apply_snapshot_defaults(sample(), req));
  EXPECT_EQ(req.image, "debian");
  EXPECT_EQ(req.driver, "process");
  EXPECT_EQ(req.command, (std::vector<std::string>{"/bin/sleep", "3600"}));
  EXPECT_EQ(req.env.at("MODE"), "test") << "the request's key wins";
  EXPECT_EQ(req.env.at("PATH"), "/bin");
  EXPECT_EQ(req.cwd, "/srv");
  ASSERT_EQ(req.ports.size(), 2u);
  EXPECT_EQ(req.ports[1].port, 22);
  EXPECT_EQ(req.memory_mb, 256);

  CreateRequest own;
  own.command = {"/bin/true"};
  own.cwd = "/";
  own.exposed_ports = {9000};
  ASSERT_TRUE(apply_snapshot_defaults(sample(), own));
  EXPECT_EQ(own.command, (std::vector<std::string>{"/bin/true"}));
  EXPECT_EQ(own.cwd, "/");
  EXPECT_TRUE(own.ports.empty()) << "ports given: none of the snapshot's are added";
}

TEST(SnapshotDefaults, AnotherImageOrDriverIsRefused) {
  CreateRequest image;
  image.image = "alpine";
  auto s = apply_snapshot_defaults(sample(), image);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.error(), Error::kInvalidArgument);
  EXPECT_NE(s.message().find("runs on the snapshot's image (debian)"), std::string::npos) << s.message();
  CreateRequest driver;
  driver.driver = "qemu";
  EXPECT_EQ(apply_snapshot_defaults(sample(), driver).error(), Error::kInvalidArgument);
  CreateRequest same;
  same.image = "debian";
  same.driver = "process";
  EXPECT_TRUE(apply_snapshot_defaults(sample(), same));
}

}  // namespace
}  // namespace sg
