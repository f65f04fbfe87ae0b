#include "snapshot/image_store.h"

#include <gtest/gtest.h>

#include <filesystem>

#include <nlohmann/json.hpp>

#include "tests/unit/snapshot/archive_builder.h"

namespace sg::snapshot {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing::Entry;
using testing::TempDir;

using Layer = std::vector<Entry>;

json image_config(const std::vector<std::string>& diff_ids) {
  return json{{"architecture", "amd64"},
              {"os", "linux"},
              {"config",
               {{"Env", {"PATH=/usr/bin:/bin", "LANG=C.UTF-8"}},
                {"Cmd", {"python3", "-m", "http.server"}},
                {"WorkingDir", "/srv"}}},
              {"rootfs", {{"type", "layers"}, {"diff_ids", diff_ids}}}};
}

class ImageStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(tmp_.path().empty());
    reopen();
  }
  void reopen() {
    store_.reset();
    auto s = ImageStore::open(tmp_.path() + "/state");
    ASSERT_TRUE(s) << s.message();
    store_ = std::move(*s);
  }
  std::string path(const std::string& name) { return tmp_.path() + "/" + name; }
  std::string layer_tar(const Layer& entries, bool gzip = false) {
    std::string p = path("layer" + std::to_string(n_++) + (gzip ? ".tar.gz" : ".tar"));
    EXPECT_TRUE(testing::write_tar(p, entries, gzip));
    return p;
  }

  // An old-style `docker save` archive: <id>/layer.tar per layer, <config hex>.json, manifest.json.
  // `corrupt_layer`: that layer's bytes change after its diff_id was taken.
  std::string docker_save(const std::string& name, const std::vector<Layer>& layers, int corrupt_layer = -1,
                          bool drop_layer = false) {
    std::vector<Entry> members;
    std::vector<std::string> diff_ids, layer_paths;
    for (size_t i = 0; i < layers.size(); ++i) {
      std::string tar = layer_tar(layers[i]);
      diff_ids.push_back(testing::digest_of(tar));
      std::string data = testing::read_file(tar);
      if (static_cast<int>(i) == corrupt_layer) data[600] ^= 1;  // inside the first member's data
      std::string member = "l" + std::to_string(i) + "/layer.tar";
      layer_paths.push_back(member);
      if (!(drop_layer && i + 1 == layers.size())) members.push_back(testing::file(member, data));
    }
    std::string config = image_config(diff_ids).dump();
    testing::write_file(path("config.json"), config);
    std::string config_member = testing::digest_of(path("config.json")).substr(7) + ".json";
    members.push_back(testing::file(config_member, config));
    json manifest = json::array({{{"Config", config_member}, {"RepoTags", {"test:latest"}}, {"Layers", layer_paths}}});
    members.push_back(testing::file("manifest.json", manifest.dump()));
    std::string out = path(name);
    EXPECT_TRUE(testing::write_tar(out, members));
    return out;
  }

  // An OCI image layout with gzip layers: oci-layout, index.json, blobs/sha256/{manifest,config,layers}.
  std::string oci_layout(const std::string& name, const std::vector<Layer>& layers) {
    std::vector<Entry> members = {testing::file("oci-layout", R"({"imageLayoutVersion":"1.0.0"})")};
    json descriptors = json::array();
    std::vector<std::string> diff_ids;
    auto add_blob = [&](const std::string& data) {
      testing::write_file(path("blob"), data);
      std::string d = testing::digest_of(path("blob"));
      members.push_back(testing::file("blobs/sha256/" + d.substr(7), data));
      return d;
    };
    for (const Layer& l : layers) {
      diff_ids.push_back(testing::digest_of(layer_tar(l)));
      std::string data = testing::read_file(layer_tar(l, true));
      descriptors.push_back({{"mediaType", "application/vnd.oci.image.layer.v1.tar+gzip"},
                             {"digest", add_blob(data)},
                             {"size", data.size()}});
    }
    std::string config = add_blob(image_config(diff_ids).dump());
    json manifest = {{"schemaVersion", 2},
                     {"mediaType", "application/vnd.oci.image.manifest.v1+json"},
                     {"config", {{"mediaType", "application/vnd.oci.image.config.v1+json"}, {"digest", config}}},
                     {"layers", descriptors}};
    std::string manifest_digest = add_blob(manifest.dump());
    json index = {{"schemaVersion", 2},
                  {"manifests", {{{"mediaType", "application/vnd.oci.image.manifest.v1+json"},
                                  {"digest", manifest_digest}}}}};
    members.push_back(testing::file("index.json", index.dump()));
    std::string out = path(name);
    EXPECT_TRUE(testing::write_tar(out, members, true));  // a compressed outer archive, too
    return out;
  }

  size_t stored_layers() { return store_->layers().list()->size(); }

  TempDir tmp_;
  std::unique_ptr<ImageStore> store_;
  int n_ = 0;
};

const Layer kBase = {testing::dir("etc"), testing::file("etc/os-release", "ID=test\n"), testing::file("srv/old", "o")};
const Layer kTop = {testing::file("srv/.wh.old", ""), testing::file("srv/app.py", "print('hi')\n")};

TEST_F(ImageStoreTest, ImportsADockerSaveArchive) {
  auto image = store_->import(docker_save("img.tar", {kBase, kTop}), "web");
  ASSERT_TRUE(image) << image.message();
  EXPECT_EQ(image->name, "web");
  EXPECT_EQ(image->format, "docker-save");
  ASSERT_EQ(image->layers.size(), 2u);
  EXPECT_TRUE(valid_digest(image->config_digest));
  EXPECT_EQ(image->config.env, (std::vector<std::string>{"PATH=/usr/bin:/bin", "LANG=C.UTF-8"}));
  EXPECT_EQ(image->config.cmd, (std::vector<std::string>{"python3", "-m", "http.server"}));
  EXPECT_EQ(image->config.working_dir, "/srv");
  EXPECT_GT(image->size_bytes, 0u);
  const LayerStore& layers = store_->layers();
  EXPECT_EQ(testing::read_file(layers.tree_path(image->layers[0]) + "/etc/os-release"), "ID=test\n");
  EXPECT_EQ(testing::read_file(layers.tree_path(image->layers[1]) + "/srv/app.py"), "print('hi')\n");
  EXPECT_TRUE(fs::is_character_file(layers.tree_path(image->layers[1]) + "/srv/old"));  // the whiteout

  auto listed = store_->list();
  ASSERT_TRUE(listed);
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].layers, image->layers);
  // What a fleet node publishes: the names alone, sorted, without the files of an image being written.
  ASSERT_TRUE(store_->import(docker_save("img2.tar", {kBase}), "api"));
  testing::write_file(tmp_.path() + "/state/images/.zz.json.tmp", "{");  // an image file being written
  ASSERT_TRUE(fs::exists(tmp_.path() + "/state/images/.zz.json.tmp"));
  EXPECT_EQ(store_->names().value(), (std::vector<std::string>{"api", "web"}));
  // The record survives a restart of the node.
  reopen();
  auto again = store_->get("web");
  ASSERT_TRUE(again) << again.message();
  EXPECT_EQ(again->config.cmd, image->config.cmd);
  EXPECT_EQ(stored_layers(), 2u);
  EXPECT_TRUE(fs::is_empty(store_->layers().root() + "/tmp"));  // staging is cleaned up
}

// Old `docker save` writes a layer that repeats an earlier one as a symlink to it.
TEST_F(ImageStoreTest, ALayerMemberThatIsASymlinkToAnotherIsFollowed) {
  std::string tar = layer_tar(kBase);
  std::string diff_id = testing::digest_of(tar);
  std::string config = image_config({diff_id, diff_id}).dump();
  json manifest = json::array({{{"Config", "config.json"}, {"Layers", {"l0/layer.tar", "l1/layer.tar"}}}});
  ASSERT_TRUE(testing::write_tar(path("linked.tar"),
                                 {testing::file("l0/layer.tar", testing::read_file(tar)),
                                  testing::symlink("l1/layer.tar", "../l0/layer.tar"),
                                  testing::file("config.json", config), testing::file("manifest.json", manifest.dump())}));
  auto image = store_->import(path("linked.tar"), "linked");
  ASSERT_TRUE(image) << image.message();
  EXPECT_EQ(image->layers, (std::vector<std::string>{diff_id, diff_id}));
  EXPECT_EQ(stored_layers(), 1u);

  ASSERT_TRUE(testing::write_tar(path("out.tar"), {testing::symlink("manifest.json", "../../etc/passwd")}));
  auto out = store_->import(path("out.tar"), "out");
  ASSERT_FALSE(out);
  EXPECT_NE(out.message().find("'manifest.json' is a symlink out of the archive"), std::string::npos) << out.message();
}

TEST_F(ImageStoreTest, ImportsAnOciLayoutWithCompressedLayers) {
  auto image = store_->import(oci_layout("oci.tar.gz", {kBase, kTop}), "oci:1");
  ASSERT_TRUE(image) << image.message();
  EXPECT_EQ(image->format, "oci");
  ASSERT_EQ(image->layers.size(), 2u);
  EXPECT_EQ(image->config.working_dir, "/srv");
  EXPECT_EQ(testing::read_file(store_->layers().tree_path(image->layers[1]) + "/srv/app.py"), "print('hi')\n");
  EXPECT_TRUE(store_->layers().verify(image->layers[0]));
}

TEST_F(ImageStoreTest, ACorruptedLayerIsRefusedAndNothingIsKept) {
  auto image = store_->import(docker_save("bad.tar", {kBase, kTop}, 1), "bad");
  ASSERT_FALSE(image);
  EXPECT_EQ(image.error(), Error::kInvalidArgument);
  EXPECT_NE(image.message().find("bad.tar: layer 2 (l1/layer.tar): digest mismatch"), std::string::npos)
      << image.message();
  EXPECT_EQ(store_->get("bad").error(), Error::kNotFound);
  EXPECT_TRUE(store_->list()->empty());
  // Layer 1 was fine and stored, but no image names it: the next open collects it.
  reopen();
  EXPECT_EQ(stored_layers(), 0u);
}

TEST_F(ImageStoreTest, AnImportThatWouldEatTheFreeSpaceReserveStopsAndKeepsNothing) {
  store_->layers().set_free_space_reserve(uint64_t{1} << 62);
  auto image = store_->import(docker_save("huge.tar", {kBase, kTop}), "huge");
  ASSERT_FALSE(image);
  EXPECT_EQ(image.error(), Error::kLimitExceeded);
  EXPECT_NE(image.message().find("huge.tar: member"), std::string::npos) << image.message();
  EXPECT_EQ(store_->get("huge").error(), Error::kNotFound);
  EXPECT_EQ(stored_layers(), 0u);
}

TEST_F(ImageStoreTest, MalformedArchivesGetAClearError) {
  auto missing = store_->import(docker_save("missing.tar", {kBase, kTop}, -1, true), "m");
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.message().find("'l1/layer.tar' (layer 2) is missing"), std::string::npos) << missing.message();

  testing::write_file(path("junk.tar"), "this is not a tar archive");
  auto junk = store_->import(path("junk.tar"), "j");
  ASSERT_FALSE(junk);
  EXPECT_NE(junk.message().find("junk.tar"), std::string::npos) << junk.message();

  ASSERT_TRUE(testing::write_tar(path("plain.tar"), {testing::file("hello", "x")}));
  auto plain = store_->import(path("plain.tar"), "p");
  ASSERT_FALSE(plain);
  EXPECT_NE(plain.message().find("neither a docker save archive"), std::string::npos) << plain.message();

  ASSERT_TRUE(testing::write_tar(path("badjson.tar"), {testing::file("manifest.json", "[{")}));
  auto badjson = store_->import(path("badjson.tar"), "b");
  ASSERT_FALSE(badjson);
  EXPECT_NE(badjson.message().find("manifest.json: not valid JSON"), std::string::npos) << badjson.message();

  ASSERT_TRUE(testing::write_tar(path("huge.tar"), {testing::file("manifest.json", std::string(kMaxJsonBytes + 1, ' '))}));
  auto huge = store_->import(path("huge.tar"), "h");
  ASSERT_FALSE(huge);
  EXPECT_EQ(huge.error(), Error::kLimitExceeded);

  ASSERT_TRUE(testing::write_tar(path("escape.tar"), {testing::file("../manifest.json", "[]")}));
  auto escape = store_->import(path("escape.tar"), "e");
  ASSERT_FALSE(escape);
  EXPECT_NE(escape.message().find("'../manifest.json'"), std::string::npos) << escape.message();

  EXPECT_EQ(store_->import(path("nope.tar"), "n").error(), Error::kNotFound);
  EXPECT_EQ(store_->import(docker_save("ok.tar", {kBase}), "../x").error(), Error::kInvalidArgument);
  EXPECT_TRUE(store_->list()->empty());
}

TEST_F(ImageStoreTest, TooManyLayersIsALimit) {
  json manifest = json::array({{{"Config", "c.json"}, {"Layers", std::vector<std::string>(kMaxImageLayers + 1, "l")}}});
  ASSERT_TRUE(testing::write_tar(path("many.tar"), {testing::file("manifest.json", manifest.dump())}));
  auto image = store_->import(path("many.tar"), "many");
  ASSERT_FALSE(image);
  EXPECT_EQ(image.error(), Error::kLimitExceeded);
  EXPECT_NE(image.message().find("129 layers"), std::string::npos) << image.message();
}

TEST_F(ImageStoreTest, ANameIsImportedOnce) {
  ASSERT_TRUE(store_->import(docker_save("a.tar", {kBase}), "web"));
  auto again = store_->import(docker_save("b.tar", {kTop}), "web");
  ASSERT_FALSE(again);
  EXPECT_EQ(again.error(), Error::kAlreadyExists);
}

TEST_F(ImageStoreTest, RemoveCollectsTheLayersNoImageUses) {
  auto a = store_->import(docker_save("a.tar", {kBase, kTop}), "a");
  ASSERT_TRUE(a) << a.message();
  auto b = store_->import(docker_save("b.tar", {kBase, {testing::file("other", "b")}}), "b");
  ASSERT_TRUE(b) << b.message();
  EXPECT_EQ(a->layers[0], b->layers[0]);  // the base layer is shared
  EXPECT_EQ(stored_layers(), 3u);

  auto removed = store_->remove("a");
  ASSERT_TRUE(removed) << removed.message();
  EXPECT_EQ(stored_layers(), 2u);
  EXPECT_TRUE(store_->layers().contains(a->layers[0]));   // b still uses it
  EXPECT_FALSE(store_->layers().contains(a->layers[1]));  // nobody does
  EXPECT_EQ(store_->get("a").error(), Error::kNotFound);
  EXPECT_EQ(store_->remove("a").error(), Error::kNotFound);

  ASSERT_TRUE(store_->remove("b"));
  EXPECT_EQ(stored_layers(), 0u);
  EXPECT_TRUE(store_->list()->empty());
}

TEST_F(ImageStoreTest, RemoveIsRefusedWhileTheImageIsInUse) {
  ASSERT_TRUE(store_->import(docker_save("a.tar", {kBase}), "busy"));
  std::vector<std::string> calls;
  store_->set_users(
      [&](const std::string& name) -> std::optional<std::string> {
        calls.push_back("claim " + name);
        return name == "busy" ? std::optional<std::string>("sandbox web") : std::nullopt;
      },
      [&](const std::string& name) { calls.push_back("release " + name); });
  auto removed = store_->remove("busy");
  ASSERT_FALSE(removed);
  EXPECT_EQ(removed.error(), Error::kConflict);
  EXPECT_NE(removed.message().find("in use by sandbox web"), std::string::npos) << removed.message();
  EXPECT_EQ(calls, std::vector<std::string>{"claim busy"});  // refused: nothing was claimed, nothing to release
  EXPECT_TRUE(store_->get("busy"));
  EXPECT_EQ(stored_layers(), 1u);

  // A claim is released whether the remove then succeeds or is refused for another reason.
  ASSERT_TRUE(store_->import(docker_save("b.tar", {kBase}), "free"));
  calls.clear();
  EXPECT_TRUE(store_->remove("free"));
  EXPECT_EQ(calls, (std::vector<std::string>{"claim free", "release free"}));
  calls.clear();
  EXPECT_FALSE(store_->remove("free"));  // gone: not found before anything is claimed
  EXPECT_TRUE(calls.empty());
  store_->set_users(nullptr, nullptr);
  EXPECT_TRUE(store_->remove("busy"));
}

// A built image (image_builder.h) shares its parent's layers; the parent stays while the child names it.
TEST_F(ImageStoreTest, ABuiltImageSharesItsParentsLayersAndPinsItsOwn) {
  auto parent = store_->import(docker_save("a.tar", {kBase}), "parent");
  ASSERT_TRUE(parent) << parent.message();
  auto pinned = store_->get_and_pin("parent");
  ASSERT_TRUE(pinned) << pinned.message();
  std::string top = layer_tar({testing::file("built", "yes")});
  auto layer = store_->add_pinned_layer(top, testing::digest_of(top), "build step 1");
  ASSERT_TRUE(layer) << layer.message();

  // Garbage collection (any rm) spares pinned layers that no image names yet.
  ASSERT_TRUE(store_->import(docker_save("other.tar", {{testing::file("x", "y")}}), "other"));
  ASSERT_TRUE(store_->remove("other"));
  EXPECT_TRUE(store_->layers().contains(*layer));

  Image child;
  child.name = "child";
  child.format = "build";
  child.parent = "parent";
  child.layers = {parent->layers[0], *layer};
  auto created = store_->create(child);
  ASSERT_TRUE(created) << created.message();
  store_->unpin(pinned->layers);
  store_->unpin({*layer});
  EXPECT_EQ(store_->create(child).error(), Error::kAlreadyExists);
  auto got = store_->get("child");
  ASSERT_TRUE(got) << got.message();
  EXPECT_EQ(got->parent, "parent");
  EXPECT_EQ(got->layers[0], parent->layers[0]);  // shared, not copied
  EXPECT_GT(got->size_bytes, 0u);

  auto refused = store_->remove("parent");
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error(), Error::kConflict);
  EXPECT_NE(refused.message().find("parent of image child"), std::string::npos) << refused.message();
  ASSERT_TRUE(store_->remove("child"));
  EXPECT_TRUE(store_->layers().contains(parent->layers[0]));
  EXPECT_FALSE(store_->layers().contains(*layer));
  ASSERT_TRUE(store_->remove("parent"));
  EXPECT_EQ(stored_layers(), 0u);
}

TEST_F(ImageStoreTest, ABuildWhoseParentWentAwayIsNotRecorded) {
  std::string top = layer_tar({testing::file("built", "yes")});
  auto layer = store_->add_pinned_layer(top, testing::digest_of(top), "build step 1");
  ASSERT_TRUE(layer) << layer.message();
  Image child;
  child.name = "orphan";
  child.parent = "gone";
  child.layers = {*layer};
  auto created = store_->create(child);
  ASSERT_FALSE(created);
  EXPECT_EQ(created.error(), Error::kNotFound);
  EXPECT_EQ(store_->get("orphan").error(), Error::kNotFound);
  store_->unpin({*layer});
  reopen();  // unnamed and unpinned: collected
  EXPECT_EQ(stored_layers(), 0u);
}

TEST_F(ImageStoreTest, ADamagedRecordIsNamedAndKeepsItsLayers) {
  ASSERT_TRUE(store_->import(docker_save("a.tar", {kBase}), "a"));
  testing::write_file(tmp_.path() + "/state/images/a.json", "{\"name\": 7");
  reopen();  // the node still starts
  EXPECT_EQ(stored_layers(), 1u);
  auto listed = store_->list();
  ASSERT_FALSE(listed);
  EXPECT_NE(listed.message().find("images/a.json: damaged image record"), std::string::npos) << listed.message();
}

TEST(ImageName, Rules) {
  EXPECT_TRUE(check_image_name("debian:12"));
  EXPECT_TRUE(check_image_name("my_image-1.0"));
  for (const std::string& bad : std::vector<std::string>{"", ".hidden", "a/b", "../x", "a b", std::string(kMaxNameLength + 1, 'a')})
    EXPECT_FALSE(check_image_name(bad)) << bad;
}

}  // namespace
}  // namespace sg::snapshot
