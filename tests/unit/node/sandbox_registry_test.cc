#include "noderuntime/sandbox_registry.h"

#include <gtest/gtest.h>

#include <cmath>
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
  // Taken: the next gap is after the second. A base between slots (another node.uid_range_base) or below the
  // range holds no slot; one shared by two records frees its slot only with the last of them.
  const std::string third = registry.new_id();
  registry.add(sandbox(third, "", base + kUidRangeSize));
  registry.add(sandbox(registry.new_id(), "", base + 3 * kUidRangeSize + 7));
  registry.add(sandbox(registry.new_id(), "", base - kUidRangeSize));
  EXPECT_EQ(*registry.free_uid_base(base), base + 3 * kUidRangeSize);
  const std::string twin = registry.new_id();
  registry.add(sandbox(twin, "", base + kUidRangeSize));
  registry.erase(third);
  EXPECT_EQ(*registry.free_uid_base(base), base + 3 * kUidRangeSize);
  registry.erase(twin);
  EXPECT_EQ(*registry.free_uid_base(base), base + kUidRangeSize) << "the slot of the removed sandboxes is free again";
  // The top range: one slot fits below 2^32, and once it is taken there is none.
  const uint32_t top = 0xFFFFFFFFu - kUidRangeSize;
  SandboxRegistry full;
  EXPECT_EQ(*full.free_uid_base(top), top);
  full.add(sandbox(full.new_id(), "", top));
  auto none = full.free_uid_base(top);
  ASSERT_FALSE(none);
  EXPECT_EQ(none.error(), Error::kLimitExceeded);
}

TEST(SandboxRegistry, ReservesEachSandboxsMemoryAndCpusUntilItIsErased) {
  SandboxRegistry registry;
  auto reservations = registry.reservations();
  auto a = sandbox(registry.new_id(), "a");
  a->rec.spec.memory_mb = 1024;
  a->rec.spec.cpus = 1.5;
  const std::string a_id = a->id();
  registry.add(std::move(a));
  auto b = sandbox(registry.new_id(), "b");
  b->rec.spec.memory_mb = 256;
  b->rec.spec.cpus = 0.25;
  registry.add(std::move(b));
  EXPECT_EQ(reservations->memory_mb.load(), 1280u);
  EXPECT_EQ(reservations->millicpus.load(), 1750u);
  registry.erase(a_id);
  EXPECT_EQ(reservations->memory_mb.load(), 256u);
  EXPECT_EQ(reservations->millicpus.load(), 250u);
  // A failed sandbox cannot run again: it holds none (released once), and one adopted failed reserves none.
  registry.release_reservation(*registry.find("b"));
  registry.release_reservation(*registry.find("b"));
  EXPECT_EQ(reservations->memory_mb.load(), 0u);
  EXPECT_EQ(reservations->millicpus.load(), 0u);
  auto failed = sandbox(registry.new_id(), "failed");
  failed->rec.state = SandboxState::kFailed;
  failed->rec.spec.memory_mb = 4096;
  registry.add(std::move(failed));
  EXPECT_EQ(reservations->memory_mb.load(), 0u);
  registry.erase(registry.find("b")->id());
  registry.erase(registry.find("failed")->id());
  EXPECT_EQ(reservations->memory_mb.load(), 0u);
}

TEST(SandboxRegistry, ACreateBeyondTheNodesMemoryOrCpusIsALimitNamingTheKey) {
  Reservations reserved;
  reserved.memory_mb = 3584;
  reserved.millicpus = 3500;
  NodeConfig node;
  SandboxSpec spec;
  spec.memory_mb = 512;
  spec.cpus = 0.5;
  EXPECT_TRUE(reservation_fits(reserved, node, spec));  // 0: no limits
  node.max_memory_mb = 4096;
  node.max_cpus = 4;
  EXPECT_TRUE(reservation_fits(reserved, node, spec));  // exactly full afterwards
  spec.memory_mb = 513;
  auto memory = reservation_fits(reserved, node, spec);
  ASSERT_FALSE(memory);
  EXPECT_EQ(memory.error(), Error::kLimitExceeded);
  EXPECT_EQ(memory.message(), "memory_mb: 513 MiB do not fit on this node (3584 of its 4096 MiB are reserved, node.max_memory_mb)");
  spec.memory_mb = 512;
  spec.cpus = 0.75;
  auto cpus = reservation_fits(reserved, node, spec);
  ASSERT_FALSE(cpus);
  EXPECT_EQ(cpus.error(), Error::kLimitExceeded);
  EXPECT_EQ(cpus.message(), "cpus: 0.75 do not fit on this node (3.5 of its 4 are reserved, node.max_cpus)");
  EXPECT_EQ(millicpus(std::nan("")), 0u);
  EXPECT_EQ(millicpus(-1), 0u);
}

}  // namespace
}  // namespace sg
