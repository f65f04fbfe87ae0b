// The session ticket key ring (proxy/ticket_keys.*) on its own: rotation keeps the newest kKept keys, and the
// text a takeover carries rebuilds the same ring or is refused whole. That the keys resume tickets across a
// reload, a rotation and a takeover is tls_test.cc's, through real handshakes.
#include "proxy/ticket_keys.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>

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
  for (const std::string& bad : {std::string(), text.substr(1), std::string(text.size(), 'g'), text + text,
                                 text.substr(0, text.size() - 1) + "z"}) {
    EXPECT_FALSE((*to)->replace_with(bad)) << bad.size() << " characters";
    EXPECT_EQ((*to)->serialize(), own) << "unchanged";
  }
  ASSERT_TRUE((*to)->replace_with(text));
  EXPECT_EQ((*to)->serialize(), text);
  EXPECT_EQ((*to)->size(), 2u);
}

}  // namespace
}  // namespace sg
