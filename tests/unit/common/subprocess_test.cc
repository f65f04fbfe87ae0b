#include "common/subprocess.h"

#include <gtest/gtest.h>

namespace sg {
namespace {

TEST(RunTool, ReturnsStdoutAndFeedsStdin) {
  auto out = run_tool({"cat"}, "hello\n");
  ASSERT_TRUE(out) << out.message();
  EXPECT_EQ(*out, "hello\n");
}

TEST(RunTool, FailureCarriesTheCommandStatusAndStderr) {
  auto out = run_tool({"sh", "-c", "echo oops >&2; exit 3"});
  ASSERT_FALSE(out);
  EXPECT_EQ(out.error(), Error::kUnavailable);
  EXPECT_NE(out.message().find("sh -c"), std::string::npos) << out.message();
  EXPECT_NE(out.message().find("exit status 3: oops"), std::string::npos) << out.message();
}

TEST(RunTool, AMissingToolIsAnIoError) {
  auto out = run_tool({"sandgate-no-such-tool"});
  ASSERT_FALSE(out);
  EXPECT_EQ(out.error(), Error::kIo) << out.message();
}

TEST(RunTool, IsKilledAtItsDeadline) {
  auto out = run_tool({"sleep", "30"}, {}, 200);
  ASSERT_FALSE(out);
  EXPECT_EQ(out.error(), Error::kTimeout) << out.message();
}

TEST(RunTool, AToolThatIgnoresItsInputDoesNotHang) {
  std::string big(4 << 20, 'x');  // more than a pipe holds
  auto out = run_tool({"true"}, big);
  EXPECT_TRUE(out) << out.message();
}

}  // namespace
}  // namespace sg
