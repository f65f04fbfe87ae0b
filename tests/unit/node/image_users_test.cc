#include "noderuntime/image_users.h"

#include <gtest/gtest.h>

namespace sg {
namespace {

TEST(ImageUsers, AnImageIsInUseUntilItsLastUserIsGone) {
  ImageUsers users;
  ASSERT_TRUE(users.add("default", "sandbox b (sb-2)"));
  ASSERT_TRUE(users.add("default", "sandbox a (sb-1)"));
  ASSERT_TRUE(users.add("other", "sandbox c (sb-3)"));
  EXPECT_EQ(users.claim_for_removal("default"), std::optional<std::string>("sandbox a (sb-1)"));
  users.remove("default", "sandbox a (sb-1)");
  EXPECT_EQ(users.claim_for_removal("default"), std::optional<std::string>("sandbox b (sb-2)"));
  users.remove("default", "sandbox b (sb-2)");
  users.remove("default", "sandbox b (sb-2)");  // twice: harmless
  EXPECT_EQ(users.claim_for_removal("other"), std::optional<std::string>("sandbox c (sb-3)"));
  EXPECT_EQ(users.claim_for_removal("default"), std::nullopt);  // no user left: claimed
}

// The half of the create/rm race the node's loop sees: between claim and release no sandbox can start on
// the image, and a refused claim (users) leaves nothing behind.
TEST(ImageUsers, NoSandboxStartsOnAnImageWhileItIsBeingRemoved) {
  ImageUsers users;
  EXPECT_EQ(users.claim_for_removal("default"), std::nullopt);
  Status refused = users.add("default", "sandbox a (sb-1)");
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error(), Error::kConflict);
  EXPECT_NE(refused.message().find("being removed"), std::string::npos) << refused.message();
  EXPECT_TRUE(users.add("other", "sandbox b (sb-2)"));  // other images are not affected
  users.release_removal("default");
  EXPECT_TRUE(users.add("default", "sandbox a (sb-1)"));
  EXPECT_EQ(users.claim_for_removal("default"), std::optional<std::string>("sandbox a (sb-1)"));
  users.remove("default", "sandbox a (sb-1)");
  EXPECT_TRUE(users.add("", "sandbox d (sb-4)"));  // a sandbox from before images uses none
  EXPECT_EQ(users.claim_for_removal(""), std::nullopt);
}

}  // namespace
}  // namespace sg
