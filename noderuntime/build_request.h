// What `sandgate image build` asks for (POST /v1/images/build), and its checks: names, package names, env,
// paths and counts. A unit of its own, with no store or sandbox behind it, so the API's request parsers
// (noderuntime/api_request.h) and their fuzz target check a build the way the builder does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/error.h"

namespace sg {

// Bounds on one build request (untrusted input): a clear kInvalidArgument/kLimitExceeded past them.
inline constexpr size_t kMaxBuildSteps = 64;             // base (or apt) + copies + runs
inline constexpr size_t kMaxBuildPackages = 256;
inline constexpr size_t kMaxBuildEnv = 128;
inline constexpr size_t kMaxBuildCommandBytes = 64 * 1024;
inline constexpr uint32_t kDefaultBuildTimeoutSecs = 1800;
inline constexpr uint32_t kMaxBuildTimeoutSecs = 6 * 3600;

struct BuildCopy {
  std::string host_path;  // absolute, on the node
  std::string dest;       // absolute, in the image
};

// One step after the base, as Dockerfile users know them: COPY or RUN.
struct BuildStep {
  enum class Kind { kCopy, kRun } kind = Kind::kRun;
  BuildCopy copy;   // kCopy
  std::string run;  // kRun: a shell command
};

struct BuildRequest {
  std::string name;
  std::string from;  // "" = a Debian base made by mmdebstrap
  std::string variant = "minbase";  // mmdebstrap --variant: minbase (with apt, so --from it can apt-get) or essential
  std::vector<std::string> packages;
  std::vector<BuildStep> steps;  // run in this order
  std::string workdir;            // "" = inherited (or "/")
  std::vector<std::string> env;   // "K=V", on top of the inherited env (same K replaced)
  uint32_t timeout_secs = kDefaultBuildTimeoutSecs;
};

// Validates a request's fields (names, package names, env, paths, counts); the message names the field.
Status check_build_request(const BuildRequest& request);

}  // namespace sg
