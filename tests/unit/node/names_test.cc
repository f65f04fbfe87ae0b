#include "common/token_digest.h"
#include "noderuntime/names.h"

#include <gtest/gtest.h>

#include <cctype>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace sg {
namespace {

TEST(ValidateName, AcceptsDnsLabels) {
  for (const char* name : {"a", "demo", "my-app", "a1", "1a", "8080", "x-1-y", "sb-short", "sb-0123456789abc", "apis",
                           "api-v2", "web8080", "a-b-c"}) {
    EXPECT_TRUE(validate_name(name).ok()) << name << ": " << validate_name(name).message();
  }
  EXPECT_TRUE(validate_name(std::string(63, 'a')).ok());
}

struct BadName {
  std::string name;
  std::string reason_contains;
};

TEST(ValidateName, RejectsWithAReason) {
  const BadName cases[] = {
      {"", "empty"},
      {std::string(64, 'a'), "at most 63"},
      {std::string(1000, 'b'), "at most 63"},
      {"Demo", "lowercase"},
      {"DEMO", "lowercase"},
      {"my_app", "'_'"},
      {"my.app", "'.'"},
      {"my app", "byte 0x20"},
      {"tab\there", "byte 0x09"},
      {std::string("nul\0byte", 8), "byte 0x00"},
      {"caf\xc3\xa9", "byte 0xc3"},
      {"a/b", "'/'"},
      {"a:b", "':'"},
      {"a*", "'*'"},
      {"-demo", "start or end"},
      {"demo-", "start or end"},
      {"-", "start or end"},
      {"xn--demo", "xn--"},
      {"ab--cd", "xn--"},
      {"sb-0123456789ab", "looks like a sandbox id"},
      {"sb-zzzzzzzzzzzz", "looks like a sandbox id"},
      {"api", "reserved"},
      {"8080-demo", "port-route"},
      {"1-a", "port-route"},
      {"0-x", "port-route"},
      {"443-", "start or end"},
  };
  for (const BadName& c : cases) {
    Status s = validate_name(c.name);
    ASSERT_FALSE(s.ok()) << "accepted: " << c.name;
    EXPECT_EQ(s.error(), Error::kInvalidArgument);
    EXPECT_NE(s.message().find(c.reason_contains), std::string::npos)
        << "name '" << c.name << "': message '" << s.message() << "' lacks '" << c.reason_contains << "'";
  }
}

TEST(LooksLikeId, ShapeOnly) {
  EXPECT_TRUE(looks_like_id("sb-0123456789ab"));
  EXPECT_TRUE(looks_like_id("sb-aaaaaaaaaaaa"));
  EXPECT_FALSE(looks_like_id("sb-0123456789a"));    // 11
  EXPECT_FALSE(looks_like_id("sb-0123456789abc"));  // 13
  EXPECT_FALSE(looks_like_id("sb-0123456789AB"));   // uppercase
  EXPECT_FALSE(looks_like_id("sb-01234567-9ab"));   // hyphen in the random part
  EXPECT_FALSE(looks_like_id("sx-0123456789ab"));
  EXPECT_FALSE(looks_like_id(""));
  EXPECT_FALSE(looks_like_id("demo"));
}

TEST(GenerateId, WellFormedAndUnique) {
  std::set<std::string> seen;
  for (int i = 0; i < 10000; ++i) {
    std::string id = generate_id();
    ASSERT_TRUE(looks_like_id(id)) << id;
    ASSERT_FALSE(validate_name(id).ok()) << "an id must never be accepted as a name";
    ASSERT_TRUE(seen.insert(id).second) << "duplicate " << id;
  }
}

TEST(GenerateId, UsesTheWholeAlphabet) {
  std::set<char> chars;
  for (int i = 0; i < 2000; ++i)
    for (char c : generate_id().substr(3)) chars.insert(c);
  EXPECT_EQ(chars.size(), 36u);
}

TEST(Token, IsPrefixedBase64UrlOf32RandomBytes) {
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    std::string t = generate_token();
    ASSERT_EQ(t.size(), 4u + 43u) << t;
    ASSERT_EQ(t.substr(0, 4), "sgt_");
    for (char c : t.substr(4))
      ASSERT_TRUE((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_')
          << t;
    ASSERT_TRUE(seen.insert(t).second) << "duplicate " << t;
  }
}

TEST(Token, DigestIsSha256Hex) {
  EXPECT_EQ(token_digest(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(token_digest("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

// The raw form the proxy compares every request's credential with, from several threads (a context each).
TEST(Token, RawDigestAndItsHexFormAgreeOnEveryThread) {
  const std::string hex = token_digest("abc");
  auto parsed = parse_token_digest(hex);
  ASSERT_TRUE(parsed);
  std::vector<std::optional<TokenDigest>> got(4);
  std::vector<std::thread> threads;
  for (auto& g : got)
    threads.emplace_back([&g] {
      for (int i = 0; i < 100; ++i) g = token_sha256("abc");
    });
  for (auto& t : threads) t.join();
  for (const auto& g : got) EXPECT_EQ(g, parsed);
  std::string upper = hex;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  EXPECT_EQ(parse_token_digest(upper), parsed);
  EXPECT_FALSE(parse_token_digest(""));
  EXPECT_FALSE(parse_token_digest(hex.substr(1)));
  EXPECT_FALSE(parse_token_digest(hex + "0"));
  EXPECT_FALSE(parse_token_digest("g" + hex.substr(1)));
}

TEST(Token, MatchesOnlyTheExactToken) {
  std::string t = generate_token();
  std::string digest = token_digest(t);
  EXPECT_TRUE(token_matches_digest(t, digest));
  EXPECT_FALSE(token_matches_digest(t + "x", digest));
  EXPECT_FALSE(token_matches_digest(t.substr(0, t.size() - 1), digest));
  EXPECT_FALSE(token_matches_digest("", digest));
  EXPECT_FALSE(token_matches_digest(t, ""));           // no token was ever set: nothing matches
  EXPECT_FALSE(token_matches_digest(t, "0123"));       // a damaged digest never matches
  EXPECT_FALSE(token_matches_digest(t, std::string(64, '0')));
}

}  // namespace
}  // namespace sg
