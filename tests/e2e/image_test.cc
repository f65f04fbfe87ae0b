// `sandgate image import / ls / rm` against a real node, with archives the test builds with tar(1).
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>

#include <nlohmann/json.hpp>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// An old-style `docker save` archive in `dir`: one layer (/etc/motd, /bin/hello), its config and manifest.json.
// `corrupt`: a byte of the layer changes after its diff_id was recorded. Returns the archive's path.
std::string make_docker_save(const std::string& dir, bool corrupt) {
  fs::create_directories(dir + "/rootfs/etc");
  fs::create_directories(dir + "/out/l0");
  write_file(dir + "/rootfs/etc/motd", "hello from an image\n");
  EXPECT_EQ(run("tar -cf " + shell_quote(dir + "/out/l0/layer.tar") + " -C " + shell_quote(dir + "/rootfs") + " .")
                .exit_code,
            0);
  std::string diff_id = "sha256:" + sha256_file(dir + "/out/l0/layer.tar");
  if (corrupt) {
    std::string data = read_file(dir + "/out/l0/layer.tar");
    data[data.size() / 3] ^= 0x20;
    write_file(dir + "/out/l0/layer.tar", data);
  }
  json config = {{"os", "linux"},
                 {"config", {{"Env", {"PATH=/bin"}}, {"Cmd", {"/bin/sh"}}, {"WorkingDir", "/"}}},
                 {"rootfs", {{"type", "layers"}, {"diff_ids", {diff_id}}}}};
  write_file(dir + "/out/config.json", config.dump());
  std::string config_name = sha256_file(dir + "/out/config.json") + ".json";
  fs::rename(dir + "/out/config.json", dir + "/out/" + config_name);
  json manifest = json::array({{{"Config", config_name}, {"RepoTags", {"e2e:latest"}}, {"Layers", {"l0/layer.tar"}}}});
  write_file(dir + "/out/manifest.json", manifest.dump());
  std::string archive = dir + "/image.tar";
  EXPECT_EQ(run("tar -cf " + shell_quote(archive) + " -C " + shell_quote(dir + "/out") + " .").exit_code, 0);
  return archive;
}

TEST(Image, ImportListRemove) {
  Cluster c(ClusterOptions::own_image_store());
  std::string archive = make_docker_save(c.dir() + "/good", false);

  auto imported = c.cli("image import " + shell_quote(archive) + " e2e-web");
  ASSERT_EQ(imported.exit_code, 0) << imported.err;
  EXPECT_EQ(imported.out.rfind("imported image e2e-web: 1 layer, ", 0), 0u) << imported.out;

  auto ls = c.cli("image ls");
  ASSERT_EQ(ls.exit_code, 0) << ls.err;
  EXPECT_EQ(ls.out.rfind("NAME", 0), 0u) << ls.out;
  EXPECT_NE(ls.out.find("\ne2e-web  "), std::string::npos) << ls.out;

  auto listed = c.cli("image ls --json");
  ASSERT_EQ(listed.exit_code, 0) << listed.err;
  json answer = json::parse(listed.out, nullptr, false);
  ASSERT_TRUE(answer.is_object()) << listed.out;
  ASSERT_EQ(answer["images"].size(), 1u);
  const json& image = answer["images"][0];
  EXPECT_EQ(image["format"], "docker-save");
  EXPECT_EQ(image["config"]["cmd"], json({"/bin/sh"}));
  ASSERT_EQ(image["layers"].size(), 1u);
  // The layer is unpacked in the node's content-addressed store.
  std::string layer = c.dir() + "/node/layers/sha256/" + image["layers"][0].get<std::string>().substr(7);
  EXPECT_EQ(read_file(layer + "/tree/etc/motd"), "hello from an image\n");

  auto inspected = c.cli("image inspect e2e-web");
  ASSERT_EQ(inspected.exit_code, 0) << inspected.err;
  EXPECT_EQ(json::parse(inspected.out, nullptr, false), image) << inspected.out;
  auto unknown = c.cli("image inspect e2e-nope");
  EXPECT_EQ(unknown.exit_code, 1);
  EXPECT_NE(unknown.err.find("no image named e2e-nope"), std::string::npos) << unknown.err;

  auto again = c.cli("image import " + shell_quote(archive) + " e2e-web");
  EXPECT_EQ(again.exit_code, 1);
  EXPECT_NE(again.err.find("sandgate image rm e2e-web"), std::string::npos) << again.err;

  auto rm = c.cli("image rm e2e-web");
  ASSERT_EQ(rm.exit_code, 0) << rm.err;
  EXPECT_EQ(rm.out, "removed image e2e-web\n");
  EXPECT_FALSE(fs::exists(layer)) << "a layer no image uses is collected";
  EXPECT_EQ(c.cli("image ls").out, "NAME  LAYERS  SIZE  FORMAT  AGE\n");

  auto gone = c.cli("image rm e2e-web");
  EXPECT_EQ(gone.exit_code, 1);
  EXPECT_NE(gone.err.find("no image named e2e-web: `sandgate image ls` lists the images"), std::string::npos)
      << gone.err;
}

TEST(Image, RemovingAnImageASandboxRunsOnIsRefused) {
  Cluster c(ClusterOptions::own_image_store());
  const std::string dir = c.dir() + "/busy";
  fs::create_directories(dir + "/rootfs/bin");
  fs::copy_file("/bin/busybox", dir + "/rootfs/bin/sleep");  // busybox-static: the applet is its name
  std::string archive = make_docker_save(dir, false);
  ASSERT_EQ(c.cli("image import " + shell_quote(archive) + " e2e-busy").exit_code, 0);
  auto created = c.cli("create --name user --image e2e-busy -- /bin/sleep 3600");
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err;

  auto refused = c.cli("image rm e2e-busy");
  EXPECT_EQ(refused.exit_code, 1);
  EXPECT_NE(refused.err.find("in use by sandbox user"), std::string::npos) << refused.err;
  EXPECT_NE(c.cli("image ls").out.find("e2e-busy"), std::string::npos);

  ASSERT_EQ(c.cli("rm user").exit_code, 0);
  auto removed = c.cli("image rm e2e-busy");
  EXPECT_EQ(removed.exit_code, 0) << removed.err;
}

TEST(Image, CorruptedArchiveIsRefusedWithAClearError) {
  Cluster c(ClusterOptions::own_image_store());
  std::string archive = make_docker_save(c.dir() + "/bad", true);
  // Relative to the CLI's directory: the CLI sends the node an absolute path.
  auto imported = run("cd " + shell_quote(c.dir()) + " && " + c.sandgate() + " --api " + shell_quote(c.api()) +
                      " image import bad/image.tar broken");
  EXPECT_EQ(imported.exit_code, 1);
  EXPECT_EQ(imported.out, "");
  EXPECT_NE(imported.err.find("sandgate: " + archive + ": layer 1 (l0/layer.tar): digest mismatch: expected sha256:"),
            std::string::npos)
      << imported.err;
  EXPECT_EQ(c.cli("image ls").out, "NAME  LAYERS  SIZE  FORMAT  AGE\n");

  auto missing = c.cli("image import /nonexistent/image.tar x");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.err.find("/nonexistent/image.tar does not exist"), std::string::npos) << missing.err;
}

}  // namespace
}  // namespace sg::e2e
