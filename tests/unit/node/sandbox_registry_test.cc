#include "noderuntime/sandbox_registry.h"

#include <gtest/gtest.h>

#include <memory>

#include "noderuntime/sandbox.h"

namespace sg {
namespace {

std::unique_ptr<LiveSandbox> sandbox(const std::string& id, const std::string& name, uint32_t uid_base = 0) {
  auto sb = std::make_unique<LiveSandbox>();
  sb->rec.spec.id = id;
  sb->rec.spec.name = name;
  sb->rec.spec.uid_base = uid_base;
  return sb;
}

TEST(SandboxRegistry, FindsBySandboxIdOrNameAndForgetsBothAtErase) {
  SandboxRegistry registry;
  const std::string id = registry.new_id();
  registry.add(sandbox(id, "web"));
  ASSERT_NE(registry.find(id), nullptr);
  EXPECT_EQ(registry.find("web"), registry.find(id));
  ASSERT_NE(registry.id_of("web"), nullptr);
  EXPECT_EQ(*registry.id_of("web"), id);
  EXPECT_EQ(registry.find("other"), nullptr);
  registry.erase(id);
  EXPECT_EQ(registry.find(id), nullptr);
  EXPECT_EQ(registry.id_of("web"), nullptr);
  EXPECT_EQ(registry.size(), 0u);
}

TEST(SandboxRegistry, ASandboxBeingRemovedIsNotUsable) {
  SandboxRegistry registry;
  const std::string id = registry.new_id();
  registry.add(sandbox(id, "web")).terminating = true;
  EXPECT_NE(registry.find("web"), nullptr);  // still listed until it is gone
  auto usable = registry.find_usable("web");
  ASSERT_FALSE(usable);
  EXPECT_EQ(usable.error(), Error::kNotFound);
  EXPECT_EQ(usable.message(), "sandbox " + id + " is being terminated");
  EXPECT_EQ(registry.find_usable("nope").message(), "no sandbox 'nope'");
}

TEST(SandboxRegistry, UidRangesAreTheLowestFreeSlots) {
  SandboxRegistry registry;
  const uint32_t base = 0x10000000;
  registry.add(sandbox(registry.new_id(), "", base));
  const std::string second = registry.new_id();
  registry.add(sandbox(second, "", base + 2 * kUidRangeSize));
  EXPECT_EQ(*registry.free_uid_base(base), base + kUidRangeSize);
  // The top range: one slot fits below 2^32, and once it is taken there is none.
  const uint32_t top = 0xFFFFFFFFu - kUidRangeSize;
  SandboxRegistry full;
  EXPECT_EQ(*full.free_uid_base(top), top);
  full.add(sandbox(full.new_id(), "", top));
  auto none = full.free_uid_base(top);
  ASSERT_FALSE(none);
  EXPECT_EQ(none.error(), Error::kLimitExceeded);
}

}  // namespace
}  // namespace sg
