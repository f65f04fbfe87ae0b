// The node killed with SIGKILL on either side of a state write (failpoints, docs/tests.md#failpoints): after
// a restart, reconcile settles each half-done transition from what it finds, the sandbox serves through the
// proxy (a request wakes it if it settled suspended), and nothing it started is left running unowned.
#include <gtest/gtest.h>

#include <filesystem>
#include <sys/wait.h>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

using namespace std::chrono_literals;

// Restarts the node (SIGKILL: a graceful stop would terminate the sandboxes) with `failpoint` armed, runs
// `command` through the CLI and checks that the node died at that failpoint. Then starts it again, unarmed.
void kill_at(Cluster& c, const std::string& failpoint, const std::string& command) {
  c.stop_node(SIGKILL);
  c.start_node({"SANDGATE_FAILPOINTS=" + failpoint});
  const size_t from = c.node().log().size();
  // suspend and resume answer once the transient state is written, so the answer may come before the kill.
  (void)c.cli(command);
  const int status = c.node().wait_exit(10000);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << failpoint << ": status " << status;
  EXPECT_NE(c.node().log().find("failpoint " + failpoint + ": SIGKILL", from), std::string::npos) << c.node().log();
  c.start_node();
}

bool settles(Cluster& c, const std::string& name, const std::string& state) {
  return eventually([&] { return c.get(name).value("state", "") == state; }, 10s);
}

// A request through the proxy answers as the sandbox's server does (waking it when it is suspended).
void serves(Cluster& c, const std::string& name) {
  auto r = c.curl("8080-" + name + ".sandbox.localhost");
  EXPECT_EQ(Cluster::http_code(r), 200) << r.out << r.err << c.proxy().log();
  EXPECT_EQ(Cluster::body(r), "hello from " + name);
}

TEST(NodeKill, OnEitherSideOfEverySuspendAndResumeWriteTheSandboxSettlesAndServes) {
  Cluster c;
  c.create_http_sandbox("k", 8080, "--timeout 600");
  c.wait_until_serving("k", 8080);

  // Killed before the freeze: the suspend never happened.
  kill_at(c, "after:running->suspending", "suspend k");
  ASSERT_TRUE(settles(c, "k", "running")) << c.get("k").dump() << c.node().log();
  EXPECT_EQ(c.get("k").value("state_reason", ""), "suspend did not complete before node restart");
  serves(c, "k");

  // Killed after the freeze, before it was recorded: found frozen, so suspended; a request wakes it.
  kill_at(c, "before:suspending->suspended", "suspend k");
  ASSERT_TRUE(settles(c, "k", "suspended")) << c.get("k").dump() << c.node().log();
  EXPECT_EQ(c.get("k").value("state_reason", ""), "suspend completed before node restart");
  serves(c, "k");

  // Killed before the thaw: the restarted node finishes the resume it finds asked for.
  ASSERT_EQ(c.cli("suspend k").exit_code, 0);
  kill_at(c, "after:suspended->resuming", "resume k");
  ASSERT_TRUE(settles(c, "k", "running")) << c.get("k").dump() << c.node().log();
  serves(c, "k");

  // Killed after the thaw, before it was recorded.
  ASSERT_EQ(c.cli("suspend k").exit_code, 0);
  kill_at(c, "before:resuming->running", "resume k");
  ASSERT_TRUE(settles(c, "k", "running")) << c.get("k").dump() << c.node().log();
  EXPECT_EQ(c.get("k").value("state_reason", ""), "resume completed before node restart");
  serves(c, "k");
}

// A create killed after its record and before the start answered (before the driver started it, and after):
// the record names no process, so the restarted node cannot adopt one. Its caller got no answer, so the
// sandbox goes as after a failed start: nothing it started keeps running, and its name is free again.
TEST(NodeKill, ACreateKilledBeforeItsStartWasRecordedLeavesNoProcessAndTheNameFree) {
  Cluster c;
  for (const std::string failpoint : {"after:creating", "before:creating->running"}) {
    SCOPED_TRACE(failpoint);
    const std::string name = failpoint == "after:creating" ? "kc1" : "kc2";
    c.stop_node(SIGKILL);
    c.start_node({"SANDGATE_FAILPOINTS=" + failpoint});
    auto r = c.cli("create --name " + name + " --public 8080 -- /usr/bin/python3 " + tool("testserver.py") +
                   " http 8080 " + name);
    EXPECT_NE(r.exit_code, 0) << r.out;
    const int status = c.node().wait_exit(15000);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status << c.node().log();
    c.start_node();
    EXPECT_TRUE(eventually([&] { return c.get(name).empty(); }, 10s)) << c.get(name).dump() << c.node().log();
    EXPECT_NE(c.node().log().find("its create did not finish before the node restarted"), std::string::npos);
    EXPECT_TRUE(eventually([&] { return run("pgrep -f 'testserver.py http 8080 " + name + "$'").exit_code != 0; }, 10s))
        << run("pgrep -af 'testserver.py http 8080 " + name + "$'").out;
    c.create_http_sandbox(name, 8080, "--timeout 600");
    c.wait_until_serving(name, 8080);
    serves(c, name);
  }
}

// `rm` killed on either side of its record's write (the driver has already stopped the sandbox): the removal
// was recorded before the driver acted, so the restarted node finishes it. The sandbox is gone without a
// second `rm`, nothing of it runs, its directory is removed and its name can be used again.
TEST(NodeKill, ARemoveKilledMidwayIsFinishedByTheRestartedNode) {
  Cluster c;
  for (const std::string failpoint : {"before:running->terminated", "after:running->terminated"}) {
    SCOPED_TRACE(failpoint);
    c.create_http_sandbox("kr", 8080, "--timeout 600");
    c.wait_until_serving("kr", 8080);
    const std::string id = c.get("kr").value("id", "");
    ASSERT_FALSE(id.empty());
    kill_at(c, failpoint, "rm kr");
    EXPECT_TRUE(eventually([&] { return c.get("kr").empty(); }, 10s)) << c.get("kr").dump() << c.node().log();
    EXPECT_NE(c.node().log().find("its removal did not finish before the node restarted"), std::string::npos)
        << c.node().log();
    EXPECT_TRUE(eventually([&] { return run("pgrep -f 'testserver.py http 8080 kr$'").exit_code != 0; }, 10s))
        << run("pgrep -af 'testserver.py http 8080 kr$'").out;
    EXPECT_TRUE(eventually([&] { return !std::filesystem::exists(c.dir() + "/node/sandboxes/" + id); }, 10s))
        << "its directory is left";
  }
  c.create_http_sandbox("kr", 8080, "--timeout 600");
  c.wait_until_serving("kr", 8080);
  serves(c, "kr");
}

}  // namespace
}  // namespace sg::e2e
