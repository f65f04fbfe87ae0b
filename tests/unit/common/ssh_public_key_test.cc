#include "common/ssh_public_key.h"

#include <gtest/gtest.h>
#include <libssh/libssh.h>

namespace sg {
namespace {

constexpr const char* kEd25519 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKqK9tu1DPCrvwKjfwhQpjPG75RyEhzsW45Xgpbv7Vmp me@host";
// Its fingerprint as `ssh-keygen -lf` prints it.
constexpr const char* kEd25519Fingerprint = "SHA256:65hTNwl7vRzhRNXuIkAqSsc4jneXgnPW9RwgKUscsgY";
constexpr const char* kRsa3072 = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABgQDGswjWRwIBI6eHcOpQ2YfWpxXZ1pbA3wHKwZRx57DjMezQlHm5f196Npk5Z1mnhXbHJINEwkcIGmqRb53WET5Dze24qgkuxNZNiv+Dt3M1r8HUyLNVRjOXB0gF/lOH2EzklGM7BBgUxB54TNQnOUVRd/KQTVmjM4hCrQIWp2aHdFbBI+PEX2RjLAaotRvlzJY+kXe4m4BqW9n1M/a+szvpwA4nQLG0A0p0RUMZ1LJQg7uznbY0h++ye3IlIZSQpNDHkPjN+XiuDWKxQuhs6utXWoD4dhHe/gGMCvpY5jat55HstKv34yUXSZic1B0ROTGkwD2nrPRDJ4yypnXdBp01vlTQS57kqfcmeC/tNTLalyqqjY7nWiqo5Ya4COSyk6otcdbIAPGwy4itzf/gqKenTLvekxleXaXM/9cyHHdLSd9zoXSBW7iJ5fb4W4dR48UH1dtHwAgB3bxnQge3ydPWVjh2iBW9z7XK9EK1T+LT1hpWy0sOSEWABR/eRf7w1cU= r";
constexpr const char* kEcdsa = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBI70VjIdMjfJzCkwKmCW1gXJDhTwIZ+wERB4nPfJjJozEa5H/D11wVEGU6emLX2Cut/29/I4eTQawUGOXEhqFmE= e";

// A freshly generated key of this type and size, as a .pub line.
std::string generated(ssh_keytypes_e type, int bits) {
  ssh_key key = nullptr;
  EXPECT_EQ(ssh_pki_generate(type, bits, &key), SSH_OK);
  char* b64 = nullptr;
  EXPECT_EQ(ssh_pki_export_pubkey_base64(key, &b64), SSH_OK);
  std::string line = std::string(ssh_key_type_to_char(type)) + " " + b64;
  ssh_string_free_char(b64);
  ssh_key_free(key);
  return line;
}

TEST(SshPublicKey, AcceptsTheUsualTypesWithTheirComment) {
  auto k = parse_public_key_line(std::string(kEd25519) + "\n");
  ASSERT_TRUE(k) << k.message();
  EXPECT_EQ(k->type, "ssh-ed25519");
  EXPECT_EQ(k->comment, "me@host");
  EXPECT_EQ(k->canonical(), "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKqK9tu1DPCrvwKjfwhQpjPG75RyEhzsW45Xgpbv7Vmp");
  auto fp = public_key_fingerprint(*k);
  ASSERT_TRUE(fp) << fp.message();
  EXPECT_EQ(*fp, kEd25519Fingerprint);
  auto rsa = parse_public_key_line(kRsa3072);
  ASSERT_TRUE(rsa) << rsa.message();
  EXPECT_EQ(rsa->type, "ssh-rsa");
  auto ecdsa = parse_public_key_line(kEcdsa);
  ASSERT_TRUE(ecdsa) << ecdsa.message();
  EXPECT_EQ(ecdsa->type, "ecdsa-sha2-nistp256");
  EXPECT_TRUE(parse_public_key_line("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKqK9tu1DPCrvwKjfwhQpjPG75RyEhzsW45Xgpbv7Vmp"));
}

TEST(SshPublicKey, RefusesWhatIsNotOneKeyOfAnAcceptedType) {
  auto refused = [](const std::string& line, const std::string& why) {
    auto k = parse_public_key_line(line);
    ASSERT_FALSE(k) << line;
    EXPECT_EQ(k.error(), Error::kInvalidArgument);
    EXPECT_NE(k.message().find(why), std::string::npos) << k.message();
  };
  refused("", "empty");
  refused("ssh-dss AAAAB3NzaC1kc3MAAACBAP", "is not one of");
  refused("command=\"ls\" " + std::string(kEd25519), "is not one of");
  refused("ssh-ed25519", "no key data");
  refused("ssh-ed25519 not*base64", "not base64");
  refused("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKqK9tu1DPCr", "not a valid");
  refused(std::string(kEd25519) + "\nssh-ed25519 AAAA", "one line");
  refused("ssh-ed25519 " + std::string(kMaxPublicKeyLine, 'A'), "longer than");
  // The line's type must be the blob's.
  std::string rsa_blob = std::string(kRsa3072).substr(8);
  refused("ssh-ed25519 " + rsa_blob, "");
  refused(generated(SSH_KEYTYPE_RSA, 1024), "1024 bits; at least 2048");
  EXPECT_TRUE(parse_public_key_line(generated(SSH_KEYTYPE_RSA, 2048)));
}

TEST(SshPublicKey, AuthorizedKeysSkipsCommentsBlanksAndBadLines) {
  std::string text = std::string("# a comment\n\n") + kEd25519 + "\nnonsense here\n" + kEcdsa + "\r\n";
  auto keys = parse_authorized_keys(text);
  ASSERT_EQ(keys.size(), 2u);
  EXPECT_EQ(keys[0].type, "ssh-ed25519");
  EXPECT_EQ(keys[1].type, "ecdsa-sha2-nistp256");
  EXPECT_TRUE(parse_authorized_keys("").empty());
}

}  // namespace
}  // namespace sg
