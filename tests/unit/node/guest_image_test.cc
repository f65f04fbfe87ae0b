// GuestImage on its own, for what the QEMU driver's tests (tests/unit/node/qemu_driver_test.cc, which cover
// building once, failures and existing images) cannot set: the builder's deadline.
#include "noderuntime/guest_image.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>
#include <optional>

#include "tests/unit/node/fake_hypervisor.h"

namespace sg {
namespace {

using testing::TempDir;
using testing::TestLoop;

TEST(GuestImageTest, BuilderOutlivingItsDeadlineIsKilledWithItsChildren) {
  TempDir dir;
  TestLoop loop;
  // The builder's child (like apt-get under the script) records its pid and hangs too.
  const std::string builder = dir.path() + "/hang";
  std::ofstream(builder) << "#!/bin/sh\necho 'build-guest-image: downloading linux-image-fake'\n"
                         << "sleep 600 &\necho $! >\"$(dirname \"$0\")/child\"\nwait\n";
  ::chmod(builder.c_str(), 0755);
  GuestImageOptions o;
  o.kernel = dir.path() + "/guest/vmlinuz";
  o.initrd = dir.path() + "/guest/initrd.img";
  o.builder = builder;
  o.timeout_ms = 1000;
  std::optional<Status> r;
  {
    GuestImage image(loop.get(), o);
    image.ensure([&](Status s) { r = std::move(s); });
    EXPECT_FALSE(r.has_value());  // never from inside ensure()
    ASSERT_TRUE(loop.run_until([&] { return r.has_value(); }, 10000));
  }
  EXPECT_EQ(r->error(), Error::kTimeout);
  EXPECT_NE(r->message().find("downloading linux-image-fake"), std::string::npos) << r->message();
  std::ifstream f(dir.path() + "/child");
  int child = 0;
  ASSERT_TRUE(f >> child);
  EXPECT_TRUE(loop.run_until([&] { return !testing::process_alive(child); }, 5000));
}

TEST(GuestImageTest, HandMadeImageIsUsedWithoutABuilder) {
  TempDir dir;
  TestLoop loop;
  GuestImageOptions o;
  o.kernel = dir.path() + "/my-kernel";
  o.initrd = dir.path() + "/my-initrd";
  std::ofstream(o.kernel) << "k";
  std::ofstream(o.initrd) << "i";
  GuestImage image(loop.get(), o);
  std::optional<Status> r;
  image.ensure([&](Status s) { r = std::move(s); });
  EXPECT_FALSE(r.has_value());
  ASSERT_TRUE(loop.run_until([&] { return r.has_value(); }));
  EXPECT_TRUE(r->ok()) << r->message();
}

}  // namespace
}  // namespace sg
