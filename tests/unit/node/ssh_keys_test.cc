#include "noderuntime/ssh_keys.h"

#include <gtest/gtest.h>
#include <libssh/libssh.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "tests/unit/temp_dir.h"

namespace sg {
namespace {

constexpr const char* kKeyA = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKqK9tu1DPCrvwKjfwhQpjPG75RyEhzsW45Xgpbv7Vmp me@host";
constexpr const char* kKeyB = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBI70VjIdMjfJzCkwKmCW1gXJDhTwIZ+wERB4nPfJjJozEa5H/D11wVEGU6emLX2Cut/29/I4eTQawUGOXEhqFmE= has a space";

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(SshKeyLabel, Rules) {
  for (const char* ok : {"laptop", "alice@work", "a", "ci_runner-2.old"}) EXPECT_TRUE(validate_ssh_key_label(ok)) << ok;
  for (std::string bad : {std::string(""), std::string("-x"), std::string(".x"), std::string("has space"),
                          std::string("a/b"), std::string("new\nline"), std::string(kMaxSshKeyLabel + 1, 'a')})
    EXPECT_FALSE(validate_ssh_key_label(bad)) << bad;
}

TEST(SshKeyStore, AddListRemoveAndReopen) {
  testing::TempDir tmp;
  const std::string dir = tmp.path() + "/ssh-keys";
  {
    auto store = SshKeyStore::open(dir);
    ASSERT_TRUE(store) << store.message();
    EXPECT_TRUE(store->list().empty());
    auto a = store->add("", kKeyA);  // the comment is a valid label
    ASSERT_TRUE(a) << a.message();
    EXPECT_EQ(a->label, "me@host");
    EXPECT_EQ(a->fingerprint, "SHA256:65hTNwl7vRzhRNXuIkAqSsc4jneXgnPW9RwgKUscsgY");
    auto b = store->add("", kKeyB);  // "has a space" is not: a label from the fingerprint
    ASSERT_TRUE(b) << b.message();
    EXPECT_TRUE(b->label.starts_with("key-")) << b->label;
    EXPECT_TRUE(validate_ssh_key_label(b->label));

    // The same key again, or the same label again, is a conflict; nothing changes.
    auto again = store->add("other", kKeyA);
    ASSERT_FALSE(again);
    EXPECT_EQ(again.error(), Error::kAlreadyExists);
    EXPECT_NE(again.message().find("as 'me@host'"), std::string::npos) << again.message();
    EXPECT_EQ(store->add("me@host", "ssh-rsa nope").error(), Error::kInvalidArgument);
    EXPECT_EQ(store->add("bad label", kKeyA).error(), Error::kInvalidArgument);
    EXPECT_EQ(store->list().size(), 2u);

    // The file the agents read: OpenSSH's format, the label as the comment, world-readable (public keys).
    std::string text = slurp(dir + "/authorized_keys");
    EXPECT_NE(text.find("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKqK9tu1DPCrvwKjfwhQpjPG75RyEhzsW45Xgpbv7Vmp me@host\n"),
              std::string::npos)
        << text;
    EXPECT_EQ(parse_authorized_keys(text).size(), 2u);
    struct stat st;
    ASSERT_EQ(::stat((dir + "/authorized_keys").c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0644u);

    EXPECT_EQ(store->remove("nope").error(), Error::kNotFound);
    ASSERT_TRUE(store->remove("me@host"));
    EXPECT_EQ(store->list().size(), 1u);
  }
  auto reopened = SshKeyStore::open(dir);
  ASSERT_TRUE(reopened) << reopened.message();
  ASSERT_EQ(reopened->list().size(), 1u);
  EXPECT_EQ(reopened->list()[0].key.type, "ecdsa-sha2-nistp256");
}

TEST(SshKeyStore, HoldsAtMostTheLimit) {
  testing::TempDir tmp;
  auto store = SshKeyStore::open(tmp.path());
  ASSERT_TRUE(store);
  for (size_t i = 0; i < kMaxSshKeys; ++i) {
    ssh_key key = nullptr;
    ASSERT_EQ(ssh_pki_generate(SSH_KEYTYPE_ED25519, 0, &key), SSH_OK);
    char* b64 = nullptr;
    ASSERT_EQ(ssh_pki_export_pubkey_base64(key, &b64), SSH_OK);
    ASSERT_TRUE(store->add("k" + std::to_string(i), std::string("ssh-ed25519 ") + b64));
    ssh_string_free_char(b64);
    ssh_key_free(key);
  }
  auto over = store->add("one-more", kKeyA);
  ASSERT_FALSE(over);
  EXPECT_EQ(over.error(), Error::kLimitExceeded);
}

TEST(SshHostKey, MadeOnceThenKept) {
  testing::TempDir tmp;
  const std::string dir = tmp.path() + "/ssh";
  auto first = ensure_host_key(dir, ::getuid());
  ASSERT_TRUE(first) << first.message();
  EXPECT_TRUE(first->starts_with("ssh-ed25519 AAAA")) << *first;
  struct stat st;
  ASSERT_EQ(::stat((dir + "/host_ed25519").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(::stat(dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  auto second = ensure_host_key(dir, ::getuid());
  ASSERT_TRUE(second);
  EXPECT_EQ(*second, *first);
  auto pub = host_public_key(dir);
  ASSERT_TRUE(pub);
  EXPECT_EQ(*pub, *first);
  EXPECT_FALSE(host_public_key(tmp.path() + "/none"));
}

}  // namespace
}  // namespace sg
