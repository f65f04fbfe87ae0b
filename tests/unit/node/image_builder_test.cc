// The image builder's request checks and mirror lookup; the builds themselves run in e2e (ImageBuild.*),
// which need root, a real node and mmdebstrap.
#include "noderuntime/image_builder.h"

#include <gtest/gtest.h>

#include "tests/unit/snapshot/archive_builder.h"

namespace sg {
namespace {

using sg::testing::TempDir;

BuildRequest valid() {
  BuildRequest r;
  r.name = "web";
  r.from = "base";
  r.packages = {"python3", "libc6:amd64", "g++"};
  r.steps = {{BuildStep::Kind::kCopy, {"/etc/hosts", "/etc/"}, ""}, {BuildStep::Kind::kRun, {}, "make"}};
  r.env = {"A_1=x=y"};
  r.workdir = "/srv/app";
  return r;
}

TEST(BuildRequestCheck, AcceptsAValidRequest) { EXPECT_TRUE(check_build_request(valid())) << check_build_request(valid()).message(); }

TEST(BuildRequestCheck, NamesTheBadField) {
  auto expect_bad = [](BuildRequest r, Error code, const std::string& needle) {
    auto s = check_build_request(r);
    ASSERT_FALSE(s) << needle;
    EXPECT_EQ(s.error(), code) << s.message();
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  };
  BuildRequest r = valid();
  r.name = "../x";
  expect_bad(r, Error::kInvalidArgument, "invalid image name");
  r = valid();
  r.from = "web";
  expect_bad(r, Error::kInvalidArgument, "built from itself");
  r = valid();
  r.variant = "buildd";
  expect_bad(r, Error::kInvalidArgument, "essential or minbase");
  r = valid();
  r.packages = {"curl && reboot"};
  expect_bad(r, Error::kInvalidArgument, "not a Debian package name");
  r = valid();
  r.packages.assign(kMaxBuildPackages + 1, "curl");
  expect_bad(r, Error::kLimitExceeded, "packages, over the limit of 256");
  r = valid();
  r.env = {"NOVALUE"};
  expect_bad(r, Error::kInvalidArgument, "KEY=VALUE");
  r = valid();
  r.env = {"A-B=1"};
  expect_bad(r, Error::kInvalidArgument, "KEY=VALUE");
  r = valid();
  r.workdir = "relative";
  expect_bad(r, Error::kInvalidArgument, "workdir");
  r = valid();
  r.steps[0].copy = {"relative", "/x"};
  expect_bad(r, Error::kInvalidArgument, "absolute path on the node");
  r = valid();
  r.steps[0].copy = {"/etc/hosts", "/../etc"};
  expect_bad(r, Error::kInvalidArgument, "copy destination");
  r = valid();
  r.steps[1].run = "";
  expect_bad(r, Error::kInvalidArgument, "run command");
  r = valid();
  r.steps[1].run = std::string(kMaxBuildCommandBytes + 1, 'x');
  expect_bad(r, Error::kInvalidArgument, "run command");
  r = valid();
  r.steps.assign(kMaxBuildSteps, {BuildStep::Kind::kRun, {}, "true"});  // + the base (apt) step: one over
  expect_bad(r, Error::kLimitExceeded, "65 build steps, over the limit of 64");
  r = valid();
  r.timeout_secs = kMaxBuildTimeoutSecs + 1;
  expect_bad(r, Error::kInvalidArgument, "timeout_secs");
}

TEST(DebianMirror, TakesTheHostsBookwormSource) {
  TempDir tmp;
  std::string deb822 = tmp.path() + "/debian.sources", list = tmp.path() + "/sources.list",
              other = tmp.path() + "/other.list";
  snapshot::testing::write_file(deb822,
                                "Types: deb\nURIs: http://security.debian.org/debian-security\nSuites: bookworm-security\n\n"
                                "Types: deb\nURIs: http://mirror.example/debian http://b.example/debian\n"
                                "Suites: bookworm bookworm-updates\nComponents: main\n");
  snapshot::testing::write_file(list, "# comment\ndeb [arch=amd64 signed-by=/k.gpg] http://list.example/debian bookworm main\n");
  snapshot::testing::write_file(other, "deb https://packages.example/apt cloud-sdk-bookworm main\n");
  EXPECT_EQ(debian_mirror({other, deb822, list}), "http://mirror.example/debian");
  EXPECT_EQ(debian_mirror({other, list}), "http://list.example/debian");
  EXPECT_EQ(debian_mirror({other}), "http://deb.debian.org/debian");
  EXPECT_EQ(debian_mirror({tmp.path() + "/missing.list"}), "http://deb.debian.org/debian");
}

}  // namespace
}  // namespace sg
