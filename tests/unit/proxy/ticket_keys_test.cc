// The session ticket key ring (proxy/ticket_keys.*) on its own: rotation keeps the newest kKept keys, the
// text a takeover carries rebuilds the same ring or is refused whole, and a key file
// (proxy.tls_ticket_key_file) is read line by line, refused naming the line, and never rotated. That the keys resume tickets across a
// reload, a rotation and a takeover is tls_test.cc's, through real handshakes.
#include "proxy/ticket_keys.h"

#include <gtest/gtest.h>

#include <openssl/rand.h>
#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <string>

#include "common/base64.h"
#include "common/hex.h"
#include "tests/unit/temp_dir.h"

namespace sg {
namespace {

constexpr size_t kHexPerKey = 2 * (16 + 32 + 32);

TEST(TicketKeys, RotationPutsAFreshKeyFirstAndKeepsTheNewestKept) {
  auto keys = TicketKeys::generate();
  ASSERT_TRUE(keys) << keys.message();
  EXPECT_EQ((*keys)->size(), 1u);
  std::string before = (*keys)->serialize();
  ASSERT_EQ(before.size(), kHexPerKey);
  for (size_t rotation = 1; rotation <= TicketKeys::kKept + 1; ++rotation) {
    ASSERT_TRUE((*keys)->rotate());
    const std::string after = (*keys)->serialize();
    EXPECT_EQ((*keys)->size(), std::min(rotation + 1, TicketKeys::kKept));
    EXPECT_EQ(after.size(), (*keys)->size() * kHexPerKey);
    EXPECT_NE(after.substr(0, kHexPerKey), before.substr(0, kHexPerKey)) << "a fresh newest key";
    EXPECT_EQ(after.substr(kHexPerKey), before.substr(0, std::min(before.size(), after.size() - kHexPerKey)))
        << "the others move down one place, the oldest beyond kKept is dropped";
    before = after;
  }
}

TEST(TicketKeys, TheTextOfARingRebuildsItAndMalformedTextChangesNothing) {
  auto from = TicketKeys::generate();
  auto to = TicketKeys::generate();
  ASSERT_TRUE(from && to);
  ASSERT_TRUE((*from)->rotate());
  const std::string text = (*from)->serialize();
  const std::string own = (*to)->serialize();
  // The last: hex up to its last character, so most of it decodes before it fails.
  // 17 keys: more than a key file may hold (a key-file proxy hands over all of its up to 16).
  for (const std::string& bad : {std::string(), text.substr(1), std::string(text.size(), 'g'),
                                 std::string((TicketKeys::kMaxFileKeys + 1) * kHexPerKey, 'a'),
                                 text.substr(0, text.size() - 1) + "z"}) {
    EXPECT_FALSE((*to)->replace_with(bad)) << bad.size() << " characters";
    EXPECT_EQ((*to)->serialize(), own) << "unchanged";
  }
  ASSERT_TRUE((*to)->replace_with(text));
  EXPECT_EQ((*to)->serialize(), text);
  EXPECT_EQ((*to)->size(), 2u);

  // A key-file proxy's 16 keys are taken whole; the successor's own rotation then keeps kKept.
  ASSERT_TRUE((*to)->replace_with(std::string(TicketKeys::kMaxFileKeys * kHexPerKey, 'a')));
  EXPECT_EQ((*to)->size(), TicketKeys::kMaxFileKeys);
  ASSERT_TRUE((*to)->rotate());
  EXPECT_EQ((*to)->size(), TicketKeys::kKept);
}

std::string random_key_line(size_t bytes = 80) {
  std::string k(bytes, '\0');
  EXPECT_EQ(RAND_bytes(reinterpret_cast<unsigned char*>(k.data()), static_cast<int>(k.size())), 1);
  return base64_encode(k);
}

// The ring's text is the keys' bytes in hex, newest first: what the file's lines say, in its order.
std::string hex_of_lines(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& line : lines) {
    auto bytes = base64_decode(line);
    EXPECT_TRUE(bytes);
    hex_append(std::span(reinterpret_cast<const unsigned char*>(bytes->data()), bytes->size()), out);
  }
  return out;
}

TEST(TicketKeys, AKeyFileIsReadInItsOrderSkippingCommentsAndBlankLines) {
  const std::string a = random_key_line(), b = random_key_line();
  auto keys = TicketKeys::parse_key_file("# issued first\n" + a + "\r\n\n   \n  " + b + "  \n# retired soon", "k");
  ASSERT_TRUE(keys) << keys.message();
  ASSERT_EQ(keys->size(), 2u);
  auto ring = TicketKeys::generate();
  ASSERT_TRUE(ring);
  (*ring)->use_file_keys(std::move(*keys));
  EXPECT_TRUE((*ring)->from_file());
  EXPECT_EQ((*ring)->serialize(), hex_of_lines({a, b}));
  ASSERT_TRUE((*ring)->rotate());
  EXPECT_EQ((*ring)->serialize(), hex_of_lines({a, b})) << "the file's owner rotates its keys, not the ring";

  ASSERT_TRUE((*ring)->use_own_keys());
  EXPECT_FALSE((*ring)->from_file());
  EXPECT_EQ((*ring)->size(), 1u);
  EXPECT_EQ((*ring)->serialize().find(hex_of_lines({a})), std::string::npos) << "a fresh key of its own";
  const std::string own = (*ring)->serialize();
  ASSERT_TRUE((*ring)->rotate());
  EXPECT_EQ((*ring)->size(), 2u) << "rotated again";
  EXPECT_EQ((*ring)->serialize().substr(kHexPerKey), own);
}

TEST(TicketKeys, AKeyFileIsRefusedNamingTheLine) {
  const std::string a = random_key_line();
  struct Case {
    std::string text;
    std::string says;
  };
  std::vector<Case> cases = {
      {"", "k: no key in it"},
      {"# only a comment\n\n", "k: no key in it"},
      {a + "\nnot base64!\n", "k line 2: not base64"},
      {"\n" + random_key_line(48), "k line 2: 48 bytes; a key is 80 (16 name, 32 AES, 32 HMAC)"},
      {a + "\n" + a.substr(0, 24) + random_key_line().substr(24) + "\n", "k line 2: the same key name as line 1"},
  };
  std::string seventeen;
  for (size_t i = 0; i <= TicketKeys::kMaxFileKeys; ++i) seventeen += random_key_line() + "\n";
  cases.push_back({seventeen, "k line 17: more than 16 keys"});
  for (const Case& c : cases) {
    auto keys = TicketKeys::parse_key_file(c.text, "k");
    ASSERT_FALSE(keys) << c.says;
    EXPECT_EQ(keys.error(), Error::kInvalidArgument);
    EXPECT_EQ(keys.message().rfind("proxy.tls_ticket_key_file: " + c.says, 0), 0u) << keys.message();
  }
  std::string sixteen;
  for (size_t i = 0; i < TicketKeys::kMaxFileKeys; ++i) sixteen += random_key_line() + "\n";
  EXPECT_TRUE(TicketKeys::parse_key_file(sixteen, "k")) << "16 is the most";
}

// Read like every secret file: a key file others can read is refused, whatever it holds.
TEST(TicketKeys, AKeyFileOthersCanReadIsRefused) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/ticket.keys";
  std::ofstream(path) << random_key_line() << "\n";
  ASSERT_EQ(::chmod(path.c_str(), 0644), 0);
  auto shared = TicketKeys::read_key_file(path);
  ASSERT_FALSE(shared);
  EXPECT_EQ(shared.error(), Error::kPermissionDenied);
  EXPECT_NE(shared.message().find("proxy.tls_ticket_key_file: " + path + " has mode 0644"), std::string::npos)
      << shared.message();
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
  auto keys = TicketKeys::read_key_file(path);
  EXPECT_TRUE(keys) << keys.message();
  auto none = TicketKeys::read_key_file("");
  ASSERT_TRUE(none) << "no file configured";
  EXPECT_TRUE(none->empty());
}

}  // namespace
}  // namespace sg
