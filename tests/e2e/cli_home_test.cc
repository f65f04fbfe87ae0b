// The CLI's files: `create` saves a sandbox's token under the HOME / XDG_CONFIG_HOME it runs with (here the
// cluster's own, never the real home) and `rm` removes it again.
#include <gtest/gtest.h>
#include <pwd.h>
#include <sys/stat.h>

#include <cstdlib>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

std::string real_home() {
  if (const char* h = std::getenv("HOME"); h != nullptr && h[0] == '/') return h;
  passwd* pw = ::getpwuid(::getuid());
  return pw != nullptr ? pw->pw_dir : "/root";
}

bool exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

TEST(CliHome, TokensGoToTheClustersHomeAndRmRemovesThem) {
  Cluster c;
  const std::string tokens = c.home() + "/.config/sandgate/tokens/";
  // The real home's token files of these names, as they are now: the CLI runs below must not touch them.
  const std::string real_tokens = real_home() + "/.config/sandgate/tokens/";
  const std::string real_alpha = read_file(real_tokens + "home-alpha");
  const std::string real_beta = read_file(real_tokens + "home-beta");
  const bool had_alpha = exists(real_tokens + "home-alpha"), had_beta = exists(real_tokens + "home-beta");

  auto alpha = nlohmann::json::parse(c.cli("create --json --name home-alpha -- /bin/sleep 600").out, nullptr, false);
  auto beta = nlohmann::json::parse(c.cli("create --json --name home-beta -- /bin/sleep 600").out, nullptr, false);
  ASSERT_TRUE(alpha.contains("token") && beta.contains("token")) << alpha.dump() << beta.dump();
  EXPECT_EQ(read_file(tokens + "home-alpha"), alpha["token"].get<std::string>() + "\n");
  EXPECT_EQ(read_file(tokens + "home-beta"), beta["token"].get<std::string>() + "\n");
  EXPECT_EQ(exists(real_tokens + "home-alpha"), had_alpha);
  EXPECT_EQ(read_file(real_tokens + "home-alpha"), real_alpha) << "a CLI run wrote into the real home";

  // rm by name removes that sandbox's token and no other.
  auto rm = c.cli("rm home-alpha");
  ASSERT_EQ(rm.exit_code, 0) << rm.err;
  EXPECT_FALSE(exists(tokens + "home-alpha"));
  EXPECT_TRUE(exists(tokens + "home-beta"));
  // rm by id finds the token by the name the node answers with.
  rm = c.cli("rm " + beta["id"].get<std::string>());
  ASSERT_EQ(rm.exit_code, 0) << rm.err;
  EXPECT_FALSE(exists(tokens + "home-beta"));

  // An unnamed sandbox's token is saved, and removed, under its id.
  auto unnamed = nlohmann::json::parse(c.cli("create --json -- /bin/sleep 600").out, nullptr, false);
  ASSERT_TRUE(unnamed.contains("id")) << unnamed.dump();
  const std::string id = unnamed["id"];
  EXPECT_TRUE(exists(tokens + id));
  ASSERT_EQ(c.cli("rm " + id).exit_code, 0);
  EXPECT_FALSE(exists(tokens + id));

  EXPECT_EQ(exists(real_tokens + "home-beta"), had_beta);
  EXPECT_EQ(read_file(real_tokens + "home-beta"), real_beta) << "a CLI run wrote into the real home";
}

// A failed rm (no such sandbox) leaves a saved token alone: it may be another node's sandbox of that name.
TEST(CliHome, RmOfAnUnknownSandboxKeepsTheSavedToken) {
  Cluster c;
  const std::string path = c.home() + "/.config/sandgate/tokens/elsewhere";
  ASSERT_EQ(c.cli("create --name elsewhere -- /bin/sleep 600").exit_code, 0);
  const std::string saved = read_file(path);
  ASSERT_FALSE(saved.empty());
  // The sandbox leaves through the raw API; the CLI's rm then finds nothing to remove.
  ASSERT_EQ(Cluster::http_code(c.api_raw("DELETE", "/v1/sandboxes/elsewhere", "")), 200);
  auto rm = c.cli("rm elsewhere");
  EXPECT_EQ(rm.exit_code, 1);
  EXPECT_EQ(read_file(path), saved);
}

}  // namespace
}  // namespace sg::e2e
