// The image builder's mirror lookup (its request checks: build_request_test.cc); the builds themselves run
// in e2e (ImageBuild.*), which need root, a real node and mmdebstrap.
#include "noderuntime/image_builder.h"

#include <gtest/gtest.h>

#include "tests/unit/snapshot/archive_builder.h"

namespace sg {
namespace {

using sg::testing::TempDir;

TEST(DebianMirror, TakesTheHostsBookwormSource) {
  TempDir tmp;
  std::string deb822 = tmp.path() + "/debian.sources", list = tmp.path() + "/sources.list",
              other = tmp.path() + "/other.list";
  snapshot::testing::write_file(deb822,
                                "Types: deb\nURIs: http://security.debian.org/debian-security\nSuites: bookworm-security\n\n"
                                "Types: deb\nURIs: http://mirror.example/debian http://b.example/debian\n"
                                "Suites: bookworm bookworm-updates\nComponents: main\n");
  snapshot::testing::write_file(list, "# comment\ndeb [arch=amd64 signed-by=/k.gpg] http://list.example/debian bookworm main\n");
  snapshot::testing::write_file(other, "deb https://packages.example/apt cloud-sdk-bookworm main\n");
  EXPECT_EQ(debian_mirror({other, deb822, list}), "http://mirror.example/debian");
  EXPECT_EQ(debian_mirror({other, list}), "http://list.example/debian");
  EXPECT_EQ(debian_mirror({other}), "http://deb.debian.org/debian");
  EXPECT_EQ(debian_mirror({tmp.path() + "/missing.list"}), "http://deb.debian.org/debian");
}

}  // namespace
}  // namespace sg
