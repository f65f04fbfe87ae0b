// The checks of a build request (what `sandgate image build` and POST /v1/images/build send): each bad field
// is named in a clear error, each limit is a kLimitExceeded.
#include "noderuntime/build_request.h"

#include <gtest/gtest.h>

namespace sg {
namespace {

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

}  // namespace
}  // namespace sg
