// The `sandgate image` pieces: request bodies, paths, tables and error wording.
#include <gtest/gtest.h>

#include "cli/commands.h"

namespace sg::cli {
namespace {

using nlohmann::json;

TimePoint at(const char* ts) { return *parse_timestamp(ts); }

TEST(ImageImportBody, MakesTheArchivePathAbsolute) {
  auto rel = image_import_body("img.tar", "web", "/home/op");
  ASSERT_TRUE(rel) << rel.message();
  EXPECT_EQ(*rel, json::parse(R"({"name":"web","archive":"/home/op/img.tar"})"));
  auto abs = image_import_body("/srv/img.tar", "web", "/home/op/");
  ASSERT_TRUE(abs);
  EXPECT_EQ((*abs)["archive"], "/srv/img.tar");
  EXPECT_EQ(image_import_body("", "web", "/").error(), Error::kInvalidArgument);
  EXPECT_EQ(image_import_body("a.tar", "", "/").error(), Error::kInvalidArgument);
}

TEST(ImageBuildBody, CarriesTheStepsAndMakesCopySourcesAbsolute) {
  ImageBuildOptions o;
  o.name = "web";
  o.from = "base";
  o.packages = {"python3", "curl"};
  using K = ImageBuildStep::Kind;
  o.steps = {{K::kCopy, "src:/app"}, {K::kRun, "make"}, {K::kCopy, "/etc/hosts:/etc/"}, {K::kRun, "make install"}};
  o.env = {"A=1"};
  o.workdir = "/app";
  auto body = image_build_body(o, "/home/op");
  ASSERT_TRUE(body) << body.message();
  EXPECT_EQ(*body, json::parse(R"({"name":"web","from":"base","workdir":"/app","packages":["python3","curl"],
    "env":["A=1"],
    "steps":[{"copy":{"source":"/home/op/src","dest":"/app"}},{"run":"make"},
             {"copy":{"source":"/etc/hosts","dest":"/etc/"}},{"run":"make install"}]})"));
  o.steps = {{K::kCopy, "nodest"}};
  auto bad = image_build_body(o, "/");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find("expected HOSTPATH:DEST"), std::string::npos) << bad.message();
  o.steps = {{K::kCopy, "src:"}};
  EXPECT_EQ(image_build_body(o, "/").error(), Error::kInvalidArgument);
}

TEST(ImageBuildProgress, StepsAndOutputLines) {
  EXPECT_EQ(format_build_event(json::parse(R"({"event":"step","step":2,"steps":3,"what":"run: make"})")),
            "step 2/3: run: make\n");
  EXPECT_EQ(format_build_event(json::parse(R"({"event":"output","step":2,"line":"gcc -c a.c"})")), "  | gcc -c a.c\n");
  EXPECT_EQ(format_build_event(json::parse(R"({"event":"layer","step":2,"digest":null})")), "");
  EXPECT_EQ(format_image_built(json::parse(R"({"name":"web","layers":["a","b"],"size_bytes":2048})")),
            "built image web: 2 layers, 2.0 KiB\n");
}

TEST(ImagePath, EncodesTheName) {
  EXPECT_EQ(image_path("debian-12"), "/v1/images/debian-12");
  EXPECT_EQ(image_path("a/../b"), "/v1/images/a%2F..%2Fb");
}

TEST(ImageFormat, BytesImportedAndList) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1536), "1.5 KiB");
  EXPECT_EQ(format_bytes(3u * 1024 * 1024 * 1024), "3.0 GiB");
  json image = json::parse(R"({"name":"web","format":"oci","layers":["sha256:a","sha256:b"],"size_bytes":2048,
                                "created_at":"2026-11-29T10:00:00.000Z"})");
  EXPECT_EQ(format_image_imported(image), "imported image web: 2 layers, 2.0 KiB (oci)\n");
  json answer = {{"images", {image}}};
  EXPECT_EQ(format_image_list(answer, at("2026-11-29T10:05:00Z")),
            "NAME  LAYERS  SIZE     FORMAT  AGE\n"
            "web   2       2.0 KiB  oci     5m\n");
  EXPECT_EQ(format_image_list(json::parse(R"({"images":[7]})"), at("2026-11-29T10:05:00Z")),
            "NAME  LAYERS  SIZE  FORMAT  AGE\n"
            "-     0       0 B   -       -\n");
}

TEST(ImageErrors, NameTheImageCommands) {
  std::string taken = error_message(409, R"({"error":"already_exists","message":"image web already exists"})",
                                    {"image import", "web", "unix:/n.sock", false});
  EXPECT_NE(taken.find("sandgate image rm web"), std::string::npos) << taken;
  EXPECT_EQ(taken.find("--name"), std::string::npos) << taken;
  std::string missing = error_message(404, R"({"error":"not_found","message":"no image named x"})",
                                      {"image rm", "x", "unix:/n.sock", false});
  EXPECT_NE(missing.find("sandgate image ls"), std::string::npos) << missing;
  std::string corrupt = error_message(400, R"({"error":"invalid_argument","message":"a.tar: layer 1: digest mismatch"})",
                                      {"image import", "x", "unix:/n.sock", false});
  EXPECT_EQ(corrupt, "a.tar: layer 1: digest mismatch");
}

}  // namespace
}  // namespace sg::cli
