// Host commands of a build (run_host_command): output lines, the tail, exit codes, the deadline. The build
// sandbox itself (namespaces, idmapped mounts) is exercised by the e2e ImageBuild.* tests on a real node.
#include "noderuntime/build_sandbox.h"

#include <gtest/gtest.h>

#include <chrono>

namespace sg {
namespace {

using Clock = std::chrono::steady_clock;

TEST(HostCommand, ForwardsLinesAndKeepsTheTail) {
  std::vector<std::string> lines;
  OutputLimits limits;
  limits.tail_lines = 2;
  auto out = run_host_command({"/bin/sh", "-c", "echo one; echo two >&2; printf 'three\\r\\nfour'; exit 3"}, {},
                              Clock::now() + std::chrono::seconds(30), limits,
                              [&](std::string_view l) { lines.emplace_back(l); });
  ASSERT_TRUE(out) << out.message();
  EXPECT_EQ(lines, (std::vector<std::string>{"one", "two", "three", "four"}));
  EXPECT_EQ(out->exit_code, 3);
  EXPECT_FALSE(out->timed_out);
  EXPECT_EQ(out->tail, (std::deque<std::string>{"three", "four"}));
}

TEST(HostCommand, CutsLongLines) {
  std::vector<std::string> lines;
  auto out = run_host_command({"/bin/sh", "-c", "head -c 10000 /dev/zero | tr '\\0' x"}, {},
                              Clock::now() + std::chrono::seconds(30), {}, [&](std::string_view l) { lines.emplace_back(l); });
  ASSERT_TRUE(out) << out.message();
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0], std::string(kMaxOutputLineBytes, 'x') + " [line cut at 4096 bytes]");
}

TEST(HostCommand, TheDeadlineKillsTheProcessGroup) {
  auto start = Clock::now();
  auto out = run_host_command({"/bin/sh", "-c", "echo started; sleep 600 & sleep 600"}, {},
                              Clock::now() + std::chrono::milliseconds(300), {}, nullptr);
  ASSERT_TRUE(out) << out.message();
  EXPECT_TRUE(out->timed_out);
  EXPECT_EQ(out->signal, SIGKILL);
  EXPECT_EQ(out->tail, (std::deque<std::string>{"started"}));
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10)) << "the background sleep kept the pipe open";
}

TEST(HostCommand, AMissingProgramIsAnError) {
  auto out = run_host_command({"/nonexistent/tool"}, {}, Clock::now() + std::chrono::seconds(5), {}, nullptr);
  ASSERT_FALSE(out);
  EXPECT_NE(out.message().find("cannot run /nonexistent/tool: execve /nonexistent/tool: errno 2"), std::string::npos)
      << out.message();
}

}  // namespace
}  // namespace sg
