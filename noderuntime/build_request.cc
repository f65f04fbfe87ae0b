#include "noderuntime/build_request.h"

#include <algorithm>
#include <cctype>
#include <string_view>

#include "snapshot/names.h"

namespace sg {
namespace {

// Debian package names (Debian policy 5.6.1), optionally with an architecture: no shell metacharacters, so
// they can go into the apt-get command line as they are.
bool valid_package(std::string_view p) {
  auto ok = [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'); };
  if (p.size() < 2 || p.size() > 128 || !ok(p[0])) return false;
  return std::all_of(p.begin(), p.end(), [&](char c) { return ok(c) || c == '+' || c == '-' || c == '.' || c == ':'; });
}

bool valid_env(std::string_view kv) {
  size_t eq = kv.find('=');
  if (eq == 0 || eq == std::string_view::npos) return false;
  return std::all_of(kv.begin(), kv.begin() + static_cast<std::ptrdiff_t>(eq),
                     [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }) &&
         kv.find('\0') == std::string_view::npos;
}

bool valid_image_path(std::string_view p) {
  return p.starts_with("/") && p.find('\0') == std::string_view::npos && snapshot::normalize_relative(p.substr(1), false);
}

}  // namespace

Status check_build_request(const BuildRequest& r) {
  if (auto s = snapshot::check_image_name(r.name); !s) return s;
  if (!r.from.empty())
    if (auto s = snapshot::check_image_name(r.from); !s) return fail(Error::kInvalidArgument, "from: " + s.message());
  if (r.from == r.name) return fail(Error::kInvalidArgument, "an image cannot be built from itself");
  if (r.variant != "essential" && r.variant != "minbase")
    return fail(Error::kInvalidArgument, "variant must be essential or minbase, not '" + r.variant + "'");
  if (r.packages.size() > kMaxBuildPackages)
    return fail(Error::kLimitExceeded, std::to_string(r.packages.size()) + " packages, over the limit of " +
                                           std::to_string(kMaxBuildPackages));
  for (const std::string& p : r.packages)
    if (!valid_package(p))
      return fail(Error::kInvalidArgument, "'" + p + "' is not a Debian package name ([a-z0-9][a-z0-9+.:-]+)");
  if (r.env.size() > kMaxBuildEnv)
    return fail(Error::kLimitExceeded, std::to_string(r.env.size()) + " env entries, over the limit of " +
                                           std::to_string(kMaxBuildEnv));
  for (const std::string& kv : r.env)
    if (!valid_env(kv)) return fail(Error::kInvalidArgument, "env '" + kv + "' is not KEY=VALUE (KEY of A-Z a-z 0-9 _)");
  if (!r.workdir.empty() && !valid_image_path(r.workdir))
    return fail(Error::kInvalidArgument, "workdir '" + r.workdir + "' is not an absolute path without '..'");
  for (const BuildStep& step : r.steps) {
    if (step.kind == BuildStep::Kind::kCopy) {
      const BuildCopy& c = step.copy;
      if (!c.host_path.starts_with("/"))
        return fail(Error::kInvalidArgument, "copy source '" + c.host_path + "' is not an absolute path on the node");
      if (!valid_image_path(c.dest))
        return fail(Error::kInvalidArgument, "copy destination '" + c.dest + "' is not an absolute path without '..'");
    } else if (step.run.empty() || step.run.size() > kMaxBuildCommandBytes || step.run.find('\0') != std::string::npos) {
      return fail(Error::kInvalidArgument, "a run command must be 1 to " + std::to_string(kMaxBuildCommandBytes) +
                                               " bytes without NUL");
    }
  }
  size_t steps = 1 + r.steps.size();
  if (steps > kMaxBuildSteps)
    return fail(Error::kLimitExceeded, std::to_string(steps) + " build steps, over the limit of " +
                                           std::to_string(kMaxBuildSteps));
  if (r.timeout_secs == 0 || r.timeout_secs > kMaxBuildTimeoutSecs)
    return fail(Error::kInvalidArgument, "timeout_secs must be 1 to " + std::to_string(kMaxBuildTimeoutSecs));
  return {};
}

}  // namespace sg
