// The `sandgate checkpoint / snapshots / snapshot rm / create --from / expose` pieces: bodies, paths and tables.
#include <gtest/gtest.h>

#include "cli/commands.h"

namespace sg::cli {
namespace {

using nlohmann::json;

TEST(CheckpointBody, OnlyTheTwoTypes) {
  EXPECT_EQ(*checkpoint_body("filesystem"), json::parse(R"({"type":"filesystem"})"));
  EXPECT_EQ(*checkpoint_body("memory"), json::parse(R"({"type":"memory"})"));
  auto bad = checkpoint_body("disk");
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error(), Error::kInvalidArgument);
  EXPECT_NE(bad.message().find("--type disk: must be filesystem or memory"), std::string::npos) << bad.message();
}

TEST(CreateFromSnapshot, TheCommandBecomesOptional) {
  CreateOptions o;
  EXPECT_EQ(create_request_body(o).error(), Error::kInvalidArgument) << "no command and no --from";
  o.from = "snap-abcdefghijkl";
  auto body = create_request_body(o);
  ASSERT_TRUE(body) << body.message();
  EXPECT_EQ((*body)["snapshot_id"], "snap-abcdefghijkl");
  EXPECT_FALSE(body->contains("command"));
  o.command = {"/bin/sh"};
  EXPECT_EQ((*create_request_body(o))["command"], json::array({"/bin/sh"}));
}

TEST(ForkFormat, TheSnapshotThenEachForkAsCreatePrintsIt) {
  json fork = json::parse(R"({"id":"sb-111111111111","name":"f-1","state":"running","token":"t1","urls":{}})");
  json answer = {{"snapshot_id", "snap-abcdefghijkl"}, {"sandboxes", {fork}}};
  EXPECT_EQ(format_fork(answer), "snapshot snap-abcdefghijkl\n" + format_created(fork));
  EXPECT_EQ(format_fork(json{{"snapshot_id", "snap-abcdefghijkl"}}), "snapshot snap-abcdefghijkl\n");
}

TEST(SnapshotFormat, IdLineAndList) {
  EXPECT_EQ(format_checkpoint(json::parse(R"({"snapshot_id":"snap-abcdefghijkl","snapshot":{}})")),
            "snap-abcdefghijkl\n");
  json answer = json::parse(R"({"snapshots":[
    {"id":"snap-abcdefghijkl","type":"filesystem","source":{"id":"sb-111111111111","name":"src"},
     "layers":["a","b"],"layer_bytes":1048576,"created_at":"2026-11-29T10:00:00.000Z"},
    {"id":"snap-mnopqrstuvwx","type":"filesystem","source":{"id":"sb-222222222222","name":null},
     "layers":["a"],"layer_bytes":0,"created_at":"2026-11-29T10:04:00.000Z"}]})");
  EXPECT_EQ(format_snapshot_list(answer, *parse_timestamp("2026-11-29T10:05:00Z")),
            "ID                 SOURCE           TYPE        LAYERS  LAYER-SIZE  AGE\n"
            "snap-abcdefghijkl  src              filesystem  2       1.0 MiB     5m\n"
            "snap-mnopqrstuvwx  sb-222222222222  filesystem  1       0 B         1m\n");
  EXPECT_EQ(format_snapshot_list(json::parse(R"({"snapshots":[]})"), *parse_timestamp("2026-11-29T10:05:00Z")),
            "ID  SOURCE  TYPE  LAYERS  LAYER-SIZE  AGE\n");
}

TEST(SnapshotPath, EncodesTheId) {
  EXPECT_EQ(snapshot_path("snap-abcdefghijkl"), "/v1/snapshots/snap-abcdefghijkl");
  EXPECT_EQ(snapshot_path("../x"), "/v1/snapshots/..%2Fx");
}

TEST(ExposeCall, APortAndItsProtocolInThePathAndBody) {
  auto call = expose_call("demo", "3000/h2c", true);
  ASSERT_TRUE(call) << call.message();
  EXPECT_EQ(call->path, "/v1/sandboxes/demo/ports/3000");
  EXPECT_EQ(call->body, json::parse(R"({"public":true,"protocol":"h2c"})"));
  EXPECT_EQ(expose_call("demo", "3000", false)->body, json::parse(R"({"public":false,"protocol":"http1"})"));
  for (const char* bad : {"x", "70000", "3000/quic", ""}) EXPECT_FALSE(expose_call("demo", bad, false)) << bad;
  json sandbox = json::parse(R"({"urls": {"3000": "https://3000-demo.sandbox.localhost/"},
                                "ports": [{"port": 3000, "public": true, "protocol": "h2c"}]})");
  EXPECT_EQ(format_exposed(sandbox, 3000), "https://3000-demo.sandbox.localhost/ (public: no token needed)\n");
  sandbox["ports"][0]["public"] = false;
  EXPECT_EQ(format_exposed(sandbox, 3000), "https://3000-demo.sandbox.localhost/\n");
}

}  // namespace
}  // namespace sg::cli
