// The `sandgate ssh-keys add / ls / rm` pieces: the body, the path and what they print.
#include <gtest/gtest.h>

#include "cli/commands.h"

namespace sg::cli {
namespace {

using nlohmann::json;

TEST(SshKeysCommands, BodyCarriesTheFileAndTheLabelWhenGiven) {
  EXPECT_EQ(ssh_key_add_body("ssh-ed25519 AAAA me\n", ""), json::parse(R"({"public_key":"ssh-ed25519 AAAA me\n"})"));
  EXPECT_EQ(ssh_key_add_body("k", "laptop"), json::parse(R"({"public_key":"k","label":"laptop"})"));
}

TEST(SshKeysCommands, PathEncodesTheLabel) {
  EXPECT_EQ(ssh_key_path("alice@work"), "/v1/ssh-keys/alice%40work");
  EXPECT_EQ(ssh_key_path("a/../b"), "/v1/ssh-keys/a%2F..%2Fb");
}

TEST(SshKeysCommands, AddedAndListed) {
  json key = {{"label", "laptop"}, {"type", "ssh-ed25519"}, {"fingerprint", "SHA256:abc"}, {"public_key", "x"}};
  EXPECT_EQ(format_ssh_key_added(key), "added laptop (ssh-ed25519 SHA256:abc)\n");
  std::string table = format_ssh_key_list(json{{"ssh_keys", json::array({key})}});
  EXPECT_NE(table.find("LABEL"), std::string::npos) << table;
  EXPECT_NE(table.find("laptop"), std::string::npos) << table;
  EXPECT_NE(table.find("SHA256:abc"), std::string::npos) << table;
  EXPECT_EQ(format_ssh_key_list(json::object()).find("laptop"), std::string::npos);
}

}  // namespace
}  // namespace sg::cli
