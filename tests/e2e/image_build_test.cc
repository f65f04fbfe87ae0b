// `sandgate image build` against a real node: --from a tiny busybox image the test imports (fast), and one
// Debian base made with mmdebstrap (the only slow test). The layers are read back from the node's store.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <chrono>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A `docker save` archive of one layer: a static busybox as /bin/sh and friends, /etc/motd, and the /proc,
// /dev and /tmp mount points a build step uses. Returns the archive's path.
std::string make_busybox_image(const std::string& dir) {
  std::string root = dir + "/rootfs";
  for (const char* d : {"/bin", "/etc", "/proc", "/dev", "/tmp"}) fs::create_directories(root + d);
  fs::copy_file("/bin/busybox", root + "/bin/busybox");
  for (const char* applet : {"sh", "cat", "echo", "rm", "mkdir", "chown", "id", "pwd", "test", "true", "ls", "sleep"})
    fs::create_symlink("busybox", root + "/bin/" + applet);
  write_file(root + "/etc/motd", "from the parent\n");
  fs::create_directories(dir + "/out/l0");
  EXPECT_EQ(run("tar -cf " + shell_quote(dir + "/out/l0/layer.tar") + " -C " + shell_quote(root) + " .").exit_code, 0);
  std::string diff_id = "sha256:" + sha256_file(dir + "/out/l0/layer.tar");
  json config = {{"os", "linux"},
                 {"config", {{"Env", {"PATH=/bin", "KEEP=1"}}}},
                 {"rootfs", {{"type", "layers"}, {"diff_ids", {diff_id}}}}};
  write_file(dir + "/out/config.json", config.dump());
  std::string config_name = sha256_file(dir + "/out/config.json") + ".json";
  fs::rename(dir + "/out/config.json", dir + "/out/" + config_name);
  write_file(dir + "/out/manifest.json", json::array({{{"Config", config_name}, {"Layers", {"l0/layer.tar"}}}}).dump());
  std::string archive = dir + "/busybox.tar";
  EXPECT_EQ(run("tar -cf " + shell_quote(archive) + " -C " + shell_quote(dir + "/out") + " .").exit_code, 0);
  return archive;
}

json image_json(Cluster& c, const std::string& name) {
  auto got = run("curl -s --unix-socket " + shell_quote(c.api().substr(5)) + " http://n/v1/images/" + name);
  return json::parse(got.out, nullptr, false);
}

std::string tree(Cluster& c, const std::string& digest) {
  return c.dir() + "/node/layers/sha256/" + digest.substr(7) + "/tree";
}

size_t stored_layers(Cluster& c) {
  size_t n = 0;
  for (const auto& e : fs::directory_iterator(c.dir() + "/node/layers/sha256")) n += e.is_directory() ? 1 : 0;
  return n;
}

bool build_debris(Cluster& c) {
  for (const auto& e : fs::directory_iterator(c.dir() + "/node/layers/tmp"))
    if (e.path().filename().string().starts_with("build-")) return true;
  return false;
}

class ImageBuild : public ::testing::Test {
 protected:
  void SetUp() override {
    auto imported = c_.cli("image import " + shell_quote(make_busybox_image(c_.dir() + "/bb")) + " bb");
    ASSERT_EQ(imported.exit_code, 0) << imported.err;
    parent_ = image_json(c_, "bb");
    ASSERT_TRUE(parent_.is_object());
  }
  Cluster c_{ClusterOptions::own_image_store()};
  json parent_;
};

// --copy and --run steps run in the order given, as a Dockerfile's COPY and RUN: a run before a copy does not
// see the copied file, one after it does.
TEST_F(ImageBuild, CopyAndRunStepsRunInTheOrderGiven) {
  write_file(c_.dir() + "/app.conf", "copied\n");
  auto built = c_.cli("image build ordered --from bb --run " +
                      shell_quote("cat /etc/app.conf > /before 2>/dev/null || echo absent > /before") + " --copy " +
                      shell_quote(c_.dir() + "/app.conf") + ":/etc/ --run " + shell_quote("cat /etc/app.conf > /after"));
  ASSERT_EQ(built.exit_code, 0) << built.err << built.out;
  EXPECT_NE(built.out.find("step 1/3: run: cat /etc/app.conf > /before"), std::string::npos) << built.out;
  EXPECT_NE(built.out.find("step 2/3: copy " + c_.dir() + "/app.conf /etc/\n"), std::string::npos) << built.out;
  EXPECT_NE(built.out.find("step 3/3: run: cat /etc/app.conf > /after"), std::string::npos) << built.out;
  json image = image_json(c_, "ordered");
  ASSERT_TRUE(image.is_object());
  ASSERT_EQ(image["layers"].size(), 4u);
  EXPECT_EQ(read_file(tree(c_, image["layers"][1]) + "/before"), "absent\n");
  EXPECT_EQ(read_file(tree(c_, image["layers"][2]) + "/etc/app.conf"), "copied\n");
  EXPECT_EQ(read_file(tree(c_, image["layers"][3]) + "/after"), "copied\n");
}

TEST_F(ImageBuild, RunAndCopyStepsAreSealedAsLayersOnTheParents) {
  write_file(c_.dir() + "/app.conf", "copied\n");
  auto built = c_.cli("image build child --from bb --workdir /tmp --env GREETING=hi --copy " +
                      shell_quote(c_.dir() + "/app.conf") + ":/etc/ --run true --run " +
                      shell_quote("echo made > /made; pwd > /pwd; echo $GREETING $KEEP; mkdir /home; echo u > /home/u; "
                                  "chown 1000:1000 /home/u; rm /etc/motd; cat /proc/self/uid_map > /uidmap; "
                                  "test -e " + c_.dir() + " || echo host-dir-hidden"));
  ASSERT_EQ(built.exit_code, 0) << built.err << built.out;
  // Progress while it builds: each step, then the tool's output lines.
  EXPECT_NE(built.out.find("step 1/3: copy " + c_.dir() + "/app.conf /etc/\n"), std::string::npos) << built.out;
  EXPECT_NE(built.out.find("step 2/3: run: true\n"), std::string::npos) << built.out;
  EXPECT_NE(built.out.find("step 3/3: run: echo made"), std::string::npos) << built.out;
  EXPECT_NE(built.out.find("  | hi 1\n"), std::string::npos) << built.out;
  EXPECT_NE(built.out.find("  | host-dir-hidden\n"), std::string::npos) << "the host's files are visible:\n" << built.out;
  EXPECT_NE(built.out.find("built image child: 3 layers"), std::string::npos) << built.out;

  json child = image_json(c_, "child");
  ASSERT_TRUE(child.is_object());
  EXPECT_EQ(child["format"], "build");
  EXPECT_EQ(child["parent"], "bb");
  // The parent's layer is shared (same digest, stored once); `run true` changed nothing, so added no layer.
  ASSERT_EQ(child["layers"].size(), 3u);
  EXPECT_EQ(child["layers"][0], parent_["layers"][0]);
  EXPECT_EQ(stored_layers(c_), 3u);
  EXPECT_EQ(child["config"]["working_dir"], "/tmp");
  EXPECT_EQ(child["config"]["env"], json({"PATH=/bin", "KEEP=1", "GREETING=hi"}));

  std::string copy = tree(c_, child["layers"][1]);
  EXPECT_EQ(read_file(copy + "/etc/app.conf"), "copied\n");
  std::string top = tree(c_, child["layers"][2]);
  struct stat st{};
  ASSERT_EQ(::stat((top + "/made").c_str(), &st), 0) << "the --run file is not in the layer";
  EXPECT_EQ(read_file(top + "/made"), "made\n");
  EXPECT_EQ(st.st_uid, 0u) << "image root's file, shifted back from the build's host range";
  EXPECT_EQ(st.st_gid, 0u);
  ASSERT_EQ(::stat((top + "/home/u").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 1000u);
  EXPECT_EQ(read_file(top + "/pwd"), "/tmp\n");
  // The step ran as root of a user namespace mapped onto an unprivileged host range.
  std::string map = read_file(top + "/uidmap");
  unsigned long inside = 1, outside = 0, count = 0;
  ASSERT_EQ(std::sscanf(map.c_str(), "%lu %lu %lu", &inside, &outside, &count), 3) << map;
  EXPECT_EQ(inside, 0u);
  EXPECT_GE(outside, 2'000'000'000u);
  EXPECT_EQ(count, 65536u);
  // `rm` of a parent's file: a whiteout in the layer (OCI .wh. in the blob, 0:0 device in the tree).
  ASSERT_EQ(::lstat((top + "/etc/motd").c_str(), &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode) && st.st_rdev == makedev(0, 0));
  auto listing = run("tar -tf " + shell_quote(fs::path(top).parent_path().string() + "/blob"));
  EXPECT_NE(listing.out.find("etc/.wh.motd"), std::string::npos) << listing.out;
  EXPECT_FALSE(build_debris(c_));

  // A grandchild builds on the child: every layer shared.
  auto grandchild = c_.cli("image build grandchild --from child --run 'test ! -e /etc/motd && cat /made'");
  ASSERT_EQ(grandchild.exit_code, 0) << grandchild.err;
  EXPECT_NE(grandchild.out.find("  | made\n"), std::string::npos) << "the whiteout did not hide the file:\n" << grandchild.out;
  EXPECT_EQ(image_json(c_, "grandchild")["layers"], child["layers"]);

  // The parent is refused while an image is built on it.
  auto rm = c_.cli("image rm bb");
  EXPECT_EQ(rm.exit_code, 1);
  EXPECT_NE(rm.err.find("image bb is the parent of image child"), std::string::npos) << rm.err;
  ASSERT_EQ(c_.cli("image rm grandchild").exit_code, 0);
  ASSERT_EQ(c_.cli("image rm child").exit_code, 0);
  EXPECT_EQ(stored_layers(c_), 1u) << "the child's own layers go with it, the parent's stays";
  EXPECT_EQ(c_.cli("image rm bb").exit_code, 0);
}

TEST_F(ImageBuild, AFailingStepNamesItselfAndLeavesNoImage) {
  auto built = c_.cli("image build broken --from bb --run 'echo made > /x' --run 'echo oops; echo bad >&2; exit 7'");
  EXPECT_EQ(built.exit_code, 1);
  EXPECT_NE(built.out.find("step 2/2: run: echo oops"), std::string::npos) << built.out;
  EXPECT_NE(built.err.find("sandgate: image build broken: step 2/2 (run: echo oops; echo bad >&2; exit 7) failed with "
                           "exit code 7; its last output lines:\n  | oops\n  | bad"),
            std::string::npos)
      << built.err;
  EXPECT_EQ(image_json(c_, "broken")["error"], "not_found");
  EXPECT_EQ(stored_layers(c_), 1u) << "the first step's layer is collected with the failed build";
  EXPECT_FALSE(build_debris(c_));

  // Refused before any work: a bad package name, an unknown parent, a taken name.
  auto bad = c_.cli("image build x --from bb --packages 'curl;reboot'");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("'curl;reboot' is not a Debian package name"), std::string::npos) << bad.err;
  auto orphan = c_.cli("image build x --from nosuch --run true");
  EXPECT_EQ(orphan.exit_code, 1);
  EXPECT_NE(orphan.err.find("no image named nosuch"), std::string::npos) << orphan.err;
  auto taken = c_.cli("image build bb --from bb --run true");
  EXPECT_EQ(taken.exit_code, 1);
  EXPECT_EQ(taken.out, "");
}

// The build timeout kills the running step (its whole PID namespace) and says so.
TEST_F(ImageBuild, TheTimeoutKillsTheRunningStep) {
  auto start = std::chrono::steady_clock::now();
  auto built = c_.cli("image build slow --from bb --timeout 2 --run 'echo started; sleep 600'");
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(built.exit_code, 1);
  EXPECT_NE(built.err.find("step 1/1 (run: echo started; sleep 600) was killed: the build passed its timeout of 2 s; "
                           "its last output lines:\n  | started"),
            std::string::npos)
      << built.err;
  EXPECT_LT(secs, 30) << "the step was not killed at the timeout";
  EXPECT_EQ(image_json(c_, "slow")["error"], "not_found");
  EXPECT_FALSE(build_debris(c_));
}

TEST_F(ImageBuild, ACorruptedParentLayerIsRefused) {
  std::string blob = c_.dir() + "/node/layers/sha256/" + parent_["layers"][0].get<std::string>().substr(7) + "/blob";
  std::string data = read_file(blob);
  data[data.size() / 2] ^= 0x01;
  write_file(blob, data);
  auto built = c_.cli("image build child --from bb --run true");
  EXPECT_EQ(built.exit_code, 1);
  EXPECT_NE(built.err.find("image bb (--from): layer " + parent_["layers"][0].get<std::string>() +
                           " is corrupted: its blob hashes to sha256:"),
            std::string::npos)
      << built.err;
  EXPECT_EQ(image_json(c_, "child")["error"], "not_found");
}

// The one slow test: a Debian bookworm base made by mmdebstrap from the host's mirror, plus a --run in it.
TEST(ImageBuildDebian, PackagesAndRunOnAnMmdebstrapBase) {
  Cluster c(ClusterOptions::own_image_store());
  auto built = c.cli("image build deb --packages python3 --run 'python3 -c \"open(\\\"/answer\\\", \\\"w\\\").write(str(6 * 7))\"'",
                     900);
  ASSERT_EQ(built.exit_code, 0) << built.err << built.out;
  EXPECT_NE(built.out.find("step 1/2: debian bookworm (mmdebstrap --variant=minbase --include=python3)"),
            std::string::npos)
      << built.out;
  EXPECT_NE(built.out.find("  | I: "), std::string::npos) << "mmdebstrap's own output is shown:\n" << built.out;
  json image = image_json(c, "deb");
  ASSERT_EQ(image["layers"].size(), 2u) << image.dump();
  EXPECT_TRUE(fs::exists(tree(c, image["layers"][0]) + "/usr/bin/python3"));
  struct stat st{};
  ASSERT_EQ(::stat((tree(c, image["layers"][0]) + "/etc/shadow").c_str(), &st), 0);
  EXPECT_EQ(st.st_gid, 42u) << "image ids as mmdebstrap made them (shadow's group)";
  EXPECT_EQ(read_file(tree(c, image["layers"][1]) + "/answer"), "42");

  // --packages on --from is an apt-get step in the build sandbox (the host's network reaches the mirror).
  auto apt = c.cli("image build deb-jq --from deb --packages jq --run 'jq --version > /jq-version'", 900);
  ASSERT_EQ(apt.exit_code, 0) << apt.err << apt.out;
  EXPECT_NE(apt.out.find("step 1/2: apt-get install jq\n"), std::string::npos) << apt.out;
  json with_jq = image_json(c, "deb-jq");
  ASSERT_EQ(with_jq["layers"].size(), 4u) << with_jq.dump();
  EXPECT_TRUE(fs::exists(tree(c, with_jq["layers"][2]) + "/usr/bin/jq"));
  // The step cleans the apt lists: the base's lock file is whited out in the layer.
  struct stat lock{};
  ASSERT_EQ(::lstat((tree(c, with_jq["layers"][2]) + "/var/lib/apt/lists/lock").c_str(), &lock), 0);
  EXPECT_TRUE(S_ISCHR(lock.st_mode) && lock.st_rdev == makedev(0, 0));
  EXPECT_EQ(read_file(tree(c, with_jq["layers"][3]) + "/jq-version").rfind("jq-1.6", 0), 0u);
}

}  // namespace
}  // namespace sg::e2e
