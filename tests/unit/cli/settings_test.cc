// Where ssh-config and ssh-proxy learn the ingress: flag, environment, the ingress file next to the node
// socket, default; and the sandgate binary using that file.
#include "cli/settings.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "cli/ssh.h"
#include "tests/unit/temp_dir.h"

namespace sg::cli {
namespace {

using sg::testing::TempDir;

Environment fake_env(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const char* name) {
    auto it = vars.find(name);
    return it == vars.end() ? std::string() : it->second;
  };
}

void write(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::trunc) << text; }

TEST(IngressFile, LivesNextToTheNodeSocket) {
  EXPECT_EQ(ingress_file_path(*parse_api_address("unix:/srv/sg/.state/node.sock")), "/srv/sg/.state/ingress");
  EXPECT_EQ(ingress_file_path(*parse_api_address("unix:/node.sock")), "/ingress");
  EXPECT_EQ(ingress_file_path(*parse_api_address("http://127.0.0.1:8081")), "");
  EXPECT_EQ(ingress_file_path(*parse_api_address("https://api.sandbox.localhost:8443")), "");
}

TEST(IngressFile, Parses) {
  auto f = parse_ingress_file("# written by deploy/quickstart.sh\n\ningress=127.0.0.1:18446\n"
                              "  cacert = /s/tls/ca.pem \ndomain=sandbox.localhost\nfuture_key=whatever\n",
                              "/s/ingress");
  ASSERT_TRUE(f) << f.message();
  EXPECT_EQ(f->ingress, "127.0.0.1:18446");
  EXPECT_EQ(f->cacert, "/s/tls/ca.pem");
  EXPECT_EQ(f->domain, "sandbox.localhost");
  auto partial = parse_ingress_file("ingress=[::1]:443", "/s/ingress");
  ASSERT_TRUE(partial) << partial.message();
  EXPECT_EQ(partial->ingress, "[::1]:443");
  EXPECT_EQ(partial->cacert, "");
  EXPECT_EQ(partial->domain, "");
}

TEST(IngressFile, MalformedLinesNameFileAndLine) {
  for (auto [text, line] : {std::pair{"ingress=127.0.0.1:8443\nnonsense\n", 2}, std::pair{"ingress=127.0.0.1\n", 1},
                            std::pair{"\n\ncacert=tls/ca.pem\n", 3}, std::pair{"domain=a b\n", 1},
                            std::pair{"ingress=h:1 %h\n", 1}}) {
    auto f = parse_ingress_file(text, "/s/ingress");
    ASSERT_FALSE(f) << text;
    EXPECT_EQ(f.error(), Error::kInvalidArgument);
    EXPECT_TRUE(f.message().starts_with("/s/ingress:" + std::to_string(line) + ": ")) << f.message();
    EXPECT_NE(f.message().find("--ingress / SANDGATE_INGRESS"), std::string::npos) << f.message();
  }
}

TEST(ResolveIngress, FlagThenEnvironmentThenFileThenDefault) {
  TempDir dir;
  const std::string file = dir.path() + "/ingress";
  write(file, "ingress=127.0.0.1:18446\ncacert=/qs/tls/ca.pem\ndomain=file.test\n");
  const IngressSettings no_flags;
  const IngressSettings flags{"127.0.0.1:1", "/flag/ca.pem", "flag.test"};
  const Environment env = fake_env({{"SANDGATE_INGRESS", "127.0.0.1:2"},
                                    {"SANDGATE_CACERT", "/env/ca.pem"},
                                    {"SANDGATE_DOMAIN", "env.test"}});
  const Environment empty_env = fake_env({});

  auto from_flags = resolve_ingress(flags, env, file);
  ASSERT_TRUE(from_flags) << from_flags.message();
  EXPECT_EQ(from_flags->settings.ingress, "127.0.0.1:1");
  EXPECT_EQ(from_flags->settings.cacert, "/flag/ca.pem");
  EXPECT_EQ(from_flags->settings.domain, "flag.test");
  EXPECT_EQ(from_flags->ingress_from, "--ingress");

  auto from_env = resolve_ingress(no_flags, env, file);
  ASSERT_TRUE(from_env) << from_env.message();
  EXPECT_EQ(from_env->settings.ingress, "127.0.0.1:2");
  EXPECT_EQ(from_env->settings.cacert, "/env/ca.pem");
  EXPECT_EQ(from_env->settings.domain, "env.test");
  EXPECT_EQ(from_env->ingress_from, "SANDGATE_INGRESS");

  auto from_file = resolve_ingress(no_flags, empty_env, file);
  ASSERT_TRUE(from_file) << from_file.message();
  EXPECT_EQ(from_file->settings.ingress, "127.0.0.1:18446");
  EXPECT_EQ(from_file->settings.cacert, "/qs/tls/ca.pem");
  EXPECT_EQ(from_file->settings.domain, "file.test");
  EXPECT_EQ(from_file->ingress_from, file);

  // Each setting on its own: an environment variable overrides only its own key of the file.
  auto mixed = resolve_ingress(no_flags, fake_env({{"SANDGATE_INGRESS", "127.0.0.1:3"}}), file);
  ASSERT_TRUE(mixed) << mixed.message();
  EXPECT_EQ(mixed->settings.ingress, "127.0.0.1:3");
  EXPECT_EQ(mixed->settings.cacert, "/qs/tls/ca.pem");

  for (const std::string& none : {dir.path() + "/missing", std::string()}) {
    auto defaults = resolve_ingress(no_flags, empty_env, none);
    ASSERT_TRUE(defaults) << defaults.message();
    EXPECT_EQ(defaults->settings.ingress, kDefaultIngress);
    EXPECT_EQ(defaults->settings.cacert, "");
    EXPECT_EQ(defaults->settings.domain, kDefaultDomain);
    EXPECT_EQ(defaults->ingress_from, "");
  }
}

TEST(ResolveIngress, BadOrUnreadableFileIsAnError) {
  TempDir dir;
  const std::string file = dir.path() + "/ingress";
  write(file, "ingress=nope\n");
  auto bad = resolve_ingress({}, fake_env({}), file);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find(file + ":1: "), std::string::npos) << bad.message();
  std::filesystem::remove(file);
  ASSERT_EQ(::mkdir(file.c_str(), 0700), 0);  // a directory where the file should be
  auto unreadable = resolve_ingress({}, fake_env({}), file);
  ASSERT_FALSE(unreadable);
  EXPECT_NE(unreadable.message().find("cannot read the ingress file"), std::string::npos) << unreadable.message();
}

TEST(ReadSmallFile, MissingTooLargeAndSymlinks) {
  TempDir dir;
  EXPECT_EQ(read_small_file(dir.path() + "/none", 10).error(), Error::kNotFound);
  write(dir.path() + "/f", "0123456789");
  EXPECT_EQ(*read_small_file(dir.path() + "/f", 10), "0123456789");
  EXPECT_EQ(read_small_file(dir.path() + "/f", 9).error(), Error::kInvalidArgument);
  std::filesystem::create_symlink(dir.path() + "/f", dir.path() + "/link");
  EXPECT_FALSE(read_small_file(dir.path() + "/link", 10));
}

// ---- the binary ----

struct CliRun {
  int code = -1;
  std::string out, err;
};

// Runs the sandgate binary under `env` (only these variables, plus PATH) and captures both streams.
CliRun run_cli(const TempDir& dir, const std::string& env, const std::string& args) {
  const std::string bin = SANDGATE_BIN_DIR "/cli/sandgate";
  std::string err_path = dir.path() + "/stderr";
  std::string cmd = "env -i PATH=/usr/bin:/bin " + env + " " + bin + " " + args + " 2>" + err_path;
  CliRun r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(err_path);
  r.err.assign(std::istreambuf_iterator<char>(in), {});
  return r;
}

class CliBinary : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::access(SANDGATE_BIN_DIR "/cli/sandgate", X_OK) != 0) GTEST_SKIP() << "the sandgate binary is not built";
    // What deploy/quickstart.sh writes next to its node socket (no node needs to run: ssh-config asks none).
    write(dir_.path() + "/ingress", "ingress=127.0.0.1:18446\ncacert=" + dir_.path() + "/tls/ca.pem\n");
    api_ = "SANDGATE_API=unix:" + dir_.path() + "/node.sock HOME=" + dir_.path();
  }
  TempDir dir_;
  std::string api_;
};

TEST_F(CliBinary, UsesTheIngressFileNextToTheSocket) {
  CliRun r = run_cli(dir_, api_, "ssh-config demo");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find(" ssh-proxy --ingress 127.0.0.1:18446 --cacert " + dir_.path() + "/tls/ca.pem %h\n"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.err, "");
}

TEST_F(CliBinary, EnvironmentAndFlagOverrideTheFile) {
  CliRun env = run_cli(dir_, api_ + " SANDGATE_INGRESS=127.0.0.1:2222", "ssh-config demo");
  ASSERT_EQ(env.code, 0) << env.err;
  EXPECT_NE(env.out.find("--ingress 127.0.0.1:2222 --cacert "), std::string::npos) << env.out;
  CliRun flag = run_cli(dir_, api_ + " SANDGATE_INGRESS=127.0.0.1:2222", "ssh-config demo --ingress edge.test:443");
  ASSERT_EQ(flag.code, 0) << flag.err;
  EXPECT_NE(flag.out.find("--ingress edge.test:443 --cacert "), std::string::npos) << flag.out;
}

TEST_F(CliBinary, WithoutAnyIngressItSaysItUsesTheDefault) {
  std::filesystem::remove(dir_.path() + "/ingress");
  CliRun r = run_cli(dir_, api_, "ssh-config demo");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("--ingress 127.0.0.1:8443 %h"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("no " + dir_.path() + "/ingress, so the block uses the default 127.0.0.1:8443; if "
                       "sandgate-proxy listens elsewhere, pass --ingress HOST:PORT"),
            std::string::npos)
      << r.err;
}

TEST_F(CliBinary, MalformedIngressFileIsAUsageError) {
  write(dir_.path() + "/ingress", "ingress=127.0.0.1\n");
  CliRun r = run_cli(dir_, api_, "ssh-config demo");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_NE(r.err.find(dir_.path() + "/ingress:1: "), std::string::npos) << r.err;
}

// ssh-proxy without --token, SANDGATE_TOKEN or a saved one: which token, where it was looked for, how to pass it.
TEST_F(CliBinary, SshProxyWithoutATokenSaysWhereItLookedAndHowToPassOne) {
  CliRun r = run_cli(dir_, api_, "ssh-proxy demo");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "sandgate: no token for sandbox demo: no token saved for demo at " + dir_.path() +
                       "/.config/sandgate/tokens/demo (`sandgate create` saves it there, for the user who created "
                       "the sandbox). Pass it with --token or SANDGATE_TOKEN\n");
}

// A malformed SANDGATE_API: the usage error says where the value came from and what a right one looks like.
TEST_F(CliBinary, MalformedApiAddressSaysWhatToSet) {
  CliRun r = run_cli(dir_, "SANDGATE_API=/run/sandgate/node.sock", "ls");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("invalid node API address '/run/sandgate/node.sock'"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("(from --api or SANDGATE_API): set it to the address sandgate-node serves, e.g. export "
                       "SANDGATE_API=unix:$PWD/.state/node.sock"),
            std::string::npos)
      << r.err;
}

}  // namespace
}  // namespace sg::cli
