#include "noderuntime/image_users.h"

#include <gtest/gtest.h>

namespace sg {
namespace {

TEST(ImageUsers, AnImageIsInUseUntilItsLastUserIsGone) {
  ImageUsers users;
  EXPECT_EQ(users.first_user("default"), std::nullopt);
  users.add("default", "sandbox b (sb-2)");
  users.add("default", "sandbox a (sb-1)");
  users.add("other", "sandbox c (sb-3)");
  EXPECT_EQ(users.first_user("default"), std::optional<std::string>("sandbox a (sb-1)"));
  users.remove("default", "sandbox a (sb-1)");
  EXPECT_EQ(users.first_user("default"), std::optional<std::string>("sandbox b (sb-2)"));
  users.remove("default", "sandbox b (sb-2)");
  users.remove("default", "sandbox b (sb-2)");  // twice: harmless
  EXPECT_EQ(users.first_user("default"), std::nullopt);
  EXPECT_EQ(users.first_user("other"), std::optional<std::string>("sandbox c (sb-3)"));
  users.add("", "sandbox d (sb-4)");  // a sandbox from before images uses none
  EXPECT_EQ(users.first_user(""), std::nullopt);
}

}  // namespace
}  // namespace sg
