// A process sandbox is a boundary (docs/security.md, "Process sandbox boundary"): asked from inside, through
// the agent's /exec with the sandbox's own token, as a user's code would, it is an unprivileged root on a root
// filesystem of its own that sees nothing of the host and cannot mount, unshare a user namespace or kexec.
// Each test fails on a process sandbox that runs as host root in the host's file system.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <sstream>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

using nlohmann::json;

std::string upper_dir(Cluster& c, const json& sandbox) {
  return c.dir() + "/node/sandboxes/" + sandbox["id"].get<std::string>() + "/upper";
}

// A small Python probe: the raw syscall's result and errno, so the test sees the kernel's answer itself.
std::string syscall_probe(const std::string& call) {
  return "import ctypes; l = ctypes.CDLL(None, use_errno=True); r = " + call + "; print(r, ctypes.get_errno())";
}

TEST(Boundary, SandboxRootIsAnUnprivilegedUserOfItsOwnRange) {
  Cluster c(ClusterOptions::with_operator_token("sgo_boundary-test-operator-token-0123456789"));
  json box = create_with_agent(c, "box", "-- /bin/sleep 3600");
  ASSERT_TRUE(box.contains("token"));
  const std::string token = box["token"];

  Exec id = sh(c, "box", token, "id -u; cat /proc/self/uid_map /proc/self/gid_map");
  ASSERT_EQ(id.code, 0) << id.out;
  std::istringstream in(id.out);
  std::string uid;
  long inside = -1, outside = -1, count = -1;
  in >> uid >> inside >> outside >> count;
  EXPECT_EQ(uid, "0") << id.out;
  // Root inside, but not the host's root: the map is not the identity ("0 0 4294967295").
  EXPECT_EQ(inside, 0) << id.out;
  EXPECT_GE(outside, 0x10000000) << id.out;
  EXPECT_EQ(count, 65536) << id.out;

  // Docker's default set (0xa80425fb), not every capability (0x1ffffffffff).
  Exec caps = sh(c, "box", token, "grep -E '^Cap(Eff|Bnd)|^NoNewPrivs|^Seccomp:' /proc/self/status");
  EXPECT_NE(caps.out.find("CapEff:\t00000000a80425fb"), std::string::npos) << caps.out;
  EXPECT_NE(caps.out.find("CapBnd:\t00000000a80425fb"), std::string::npos) << caps.out;
  EXPECT_NE(caps.out.find("NoNewPrivs:\t1"), std::string::npos) << caps.out;
  EXPECT_NE(caps.out.find("Seccomp:\t2"), std::string::npos) << caps.out;
}

TEST(Boundary, TheHostsFilesAreNotThereAndWritesStayInTheSandbox) {
  Cluster c(ClusterOptions::with_operator_token("sgo_boundary-test-operator-token-0123456789"));
  json box = create_with_agent(c, "box", "-- /bin/sleep 3600");
  ASSERT_TRUE(box.contains("token"));
  const std::string token = box["token"];
  // Each of these exists on the host (the CLI saved the token under the cluster's home), whatever else the
  // machine holds: this checkout stands for the host's own files (a fresh machine has no ~/.config/sandgate).
  const std::vector<std::string> host_paths = {c.dir() + "/node", c.dir() + "/operator.token",
                                               c.home() + "/.config/sandgate", source("tests/e2e"),
                                               c.dir() + "/tls/server.key", test_image().store};
  std::string script;
  for (const std::string& p : host_paths) {
    EXPECT_TRUE(std::filesystem::exists(p)) << p << " should exist on the host for this test to mean anything";
    script += "test -e " + shell_quote(p) + " && echo visible: " + shell_quote(p) + "; ";
  }
  Exec seen = sh(c, "box", token, script + "echo checked");
  EXPECT_EQ(seen.out, "checked\n");

  const std::string marker = "/sandgate-boundary-" + box["id"].get<std::string>();
  Exec wrote = sh(c, "box", token, "echo inside > " + marker + " && cat " + marker);
  EXPECT_EQ(wrote.out, "inside\n");
  EXPECT_FALSE(std::filesystem::exists(marker)) << "a write to the sandbox's / reached the host's /";
  // It is in the sandbox's upper dir, owned by the sandbox's root: a host uid of its range, not 0.
  struct stat st{};
  ASSERT_EQ(::stat((upper_dir(c, box) + marker).c_str(), &st), 0);
  EXPECT_GE(st.st_uid, 0x10000000u);

  // The host's cgroup tree is not mounted, and no cgroup.procs can be written.
  Exec cg = sh(c, "box", token,
               "for f in /sys/fs/cgroup/cgroup.procs /sys/fs/cgroup/unified/cgroup.procs "
               "/sys/fs/cgroup/pids/cgroup.procs; do (echo $$ > $f) 2>/dev/null && echo wrote $f; done; echo done");
  EXPECT_EQ(cg.out, "done\n");
}

// node.batch_scheduling (on by default): the sandbox's init, its command and what the agent runs for /exec
// are SCHED_BATCH (3), so none of them preempts the proxy or the node when a packet wakes it.
TEST(Boundary, ASandboxsProcessesRunUnderSchedBatch) {
  Cluster c;
  json box = create_with_agent(c, "box", "-- /bin/sleep 3600");
  ASSERT_TRUE(box.contains("token"));
  Exec policy = exec_in(c, "box", box["token"],
                        {"python3", "-c",
                         "import os, subprocess\n"
                         "sleep = int(subprocess.check_output(['pgrep', '-x', 'sleep']).split()[0])\n"
                         "print(os.sched_getscheduler(0), os.sched_getscheduler(1), os.sched_getscheduler(sleep))"});
  EXPECT_EQ(policy.out, "3 3 3\n");
}

TEST(Boundary, MountUnshareOfAUserNamespaceAndKexecFailWithEperm) {
  Cluster c;
  json box = create_with_agent(c, "box", "-- /bin/sleep 3600");
  ASSERT_TRUE(box.contains("token"));
  const std::string token = box["token"];
  // EPERM is 1.
  Exec m = exec_in(c, "box", token,
                   {"python3", "-c", syscall_probe("l.mount(b'none', b'/mnt', b'tmpfs', 0, None)")});
  EXPECT_EQ(m.out, "-1 1\n");
  Exec u = exec_in(c, "box", token, {"python3", "-c", syscall_probe("l.unshare(0x10000000)")});  // CLONE_NEWUSER
  EXPECT_EQ(u.out, "-1 1\n");
  Exec k = exec_in(c, "box", token, {"python3", "-c", syscall_probe("l.syscall(246, 0, 0, 0, 0)")});  // kexec_load
  EXPECT_EQ(k.out, "-1 1\n");
  // The tools a user would reach for fail the same way.
  Exec tools = sh(c, "box", token, "mount -t tmpfs none /mnt; echo mount=$?; unshare -U true; echo unshare=$?");
  EXPECT_NE(tools.out.find("mount=32"), std::string::npos) << tools.out;
  EXPECT_NE(tools.out.find("unshare=1"), std::string::npos) << tools.out;
  EXPECT_NE(tools.out.find("Operation not permitted"), std::string::npos) << tools.out;
}

TEST(Boundary, AForkBombStopsAtPidsMaxWhileTheNodeAndAnotherSandboxServe) {
  Cluster c;
  c.create_http_sandbox("other", 8080);
  c.wait_until_serving("other", 8080);
  json bomb = create_with_agent(c, "bomb", "--pids-max 64 -- /bin/sleep 3600");
  ASSERT_TRUE(bomb.contains("token"));
  EXPECT_EQ(c.get("bomb")["pids_max"], 64);
  const std::string token = bomb["token"];
  const std::string id = bomb["id"];

  // Every process forks forever; the exec's timeout ends it (its process group is killed).
  json body = {{"command", {"python3", "-c",
                            "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass"}},
               {"timeout_secs", 8}};
  Daemon bomber;
  ASSERT_TRUE(bomber.start({"/bin/sh", "-c",
                            "curl -sS --cacert " + shell_quote(c.ca()) + " --resolve bomb.sandbox.localhost:" +
                                std::to_string(c.port()) + ":127.0.0.1 -X POST -H 'Content-Type: application/json' " +
                                "--data " + shell_quote(body.dump()) + " " + bearer(token) + " " +
                                shell_quote(c.url("bomb.sandbox.localhost", "/exec"))},
                           c.dir() + "/bomb.log"));
  // The kernel refuses forks past the limit: pids.events counts them.
  auto refused = [&] {
    auto r = run("cat /sys/fs/cgroup/pids/*/" + id + "/pids.events /sys/fs/cgroup/unified/*/" + id +
                 "/pids.events /sys/fs/cgroup/*/" + id + "/pids.events 2>/dev/null");
    return r.out.find("max ") != std::string::npos && r.out.find("max 0") == std::string::npos;
  };
  ASSERT_TRUE(eventually(refused, std::chrono::seconds(20)));
  auto current = run("cat /sys/fs/cgroup/pids/*/" + id + "/pids.current /sys/fs/cgroup/unified/*/" + id +
                     "/pids.current 2>/dev/null | head -1");
  EXPECT_LE(std::atoi(current.out.c_str()), 64) << current.out;
  // Meanwhile the node answers and the other sandbox serves through the ingress.
  EXPECT_EQ(c.cli("ls").exit_code, 0);
  EXPECT_EQ(Cluster::body(c.curl("8080-other.sandbox.localhost", "/", "", 20)), "hello from other");
  bomber.stop(SIGKILL);
  EXPECT_EQ(c.cli("rm bomb").exit_code, 0);
}

TEST(Boundary, DiskMbStopsWritesWithEnospc) {
  Cluster c;
  json box = create_with_agent(c, "box", "--disk-mb 32 -- /bin/sleep 3600");
  ASSERT_TRUE(box.contains("token"));
  EXPECT_EQ(c.get("box")["disk_mb"], 32);
  Exec dd = sh(c, "box", box["token"], "dd if=/dev/zero of=/root/fill bs=1M count=64 2>&1; echo dd=$?");
  EXPECT_NE(dd.out.find("No space left on device"), std::string::npos) << dd.out;
  EXPECT_NE(dd.out.find("dd=1"), std::string::npos) << dd.out;
}

TEST(Boundary, TwoSandboxesSeeNeitherTheOthersFilesNorItsProcesses) {
  Cluster c;
  json a = create_with_agent(c, "alpha", "-- /bin/sleep 3601");
  json b = create_with_agent(c, "beta", "-- /bin/sleep 3602");
  ASSERT_TRUE(a.contains("token") && b.contains("token"));
  EXPECT_EQ(sh(c, "alpha", a["token"], "echo secret > /root/alpha-secret && echo ok").out, "ok\n");
  Exec from_beta = sh(c, "beta", b["token"],
                      "test -e /root/alpha-secret && echo sees-file; test -e " + shell_quote(upper_dir(c, a)) +
                          " && echo sees-upper; ps -eo args | grep -c '^/bin/sleep 360[1]$'; ps -eo args | grep -c '^/bin/sleep 360[2]$'");
  EXPECT_EQ(from_beta.out, "0\n1\n") << "beta saw alpha's file or process:\n" << from_beta.out;
}

// Packages install inside (dpkg writes /usr, /var/lib/dpkg, /etc; useradd writes /etc/passwd and chowns a
// home to a uid of the range). The sandbox has no network, so the .deb is fetched on the host and uploaded.
TEST(Boundary, AptGetInstallAndWritesToEtcWorkInside) {
  Cluster c;
  const std::string debs = c.dir() + "/debs";
  std::filesystem::create_directories(debs);
  auto fetched = run("cd " + shell_quote(debs) + " && apt-get download hello 2>&1 && ls", 120);
  if (fetched.exit_code != 0) GTEST_SKIP() << "SKIPPED LOUDLY: cannot fetch a .deb from the Debian mirror: " << fetched.out;
  std::string deb = fetched.out.substr(fetched.out.rfind("hello_"));
  while (!deb.empty() && deb.back() == '\n') deb.pop_back();

  json box = create_with_agent(c, "box", "-- /bin/sleep 3600");
  ASSERT_TRUE(box.contains("token"));
  const std::string token = box["token"];
  auto put = c.curl("box.sandbox.localhost", "/files?path=/tmp/hello.deb",
                    "-X PUT --data-binary @" + shell_quote(debs + "/" + deb) + " " + bearer(token));
  ASSERT_EQ(Cluster::http_code(put), 201) << put.out;
  Exec apt = sh(c, "box", token, "apt-get install -y /tmp/hello.deb 2>&1 && hello && useradd -m bob && ls -ln /home");
  ASSERT_EQ(apt.code, 0) << apt.out;
  EXPECT_NE(apt.out.find("Hello, world!"), std::string::npos) << apt.out;
  struct stat st{};
  ASSERT_EQ(::stat((upper_dir(c, box) + "/usr/bin/hello").c_str(), &st), 0);
  EXPECT_GE(st.st_uid, 0x10000000u);
  ASSERT_EQ(::stat((upper_dir(c, box) + "/home/bob").c_str(), &st), 0);
  EXPECT_GE(st.st_uid, 0x10000000u + 1000);
  EXPECT_LT(st.st_uid, 0x10000000u + 65536);

  // What was installed is in a checkpoint: a sandbox from it (another uid range) runs the package, dpkg knows
  // it, and bob's home is bob's.
  auto checkpoint = c.cli("checkpoint box");
  ASSERT_EQ(checkpoint.exit_code, 0) << checkpoint.out << checkpoint.err;
  std::string snap = checkpoint.out;
  while (!snap.empty() && snap.back() == '\n') snap.pop_back();
  json copy = create_with_agent(c, "copy", "--from " + snap);
  ASSERT_TRUE(copy.contains("token")) << copy.dump();
  Exec there = sh(c, "copy", copy["token"], "hello && dpkg -s hello | grep Status && stat -c %U /home/bob");
  EXPECT_EQ(there.code, 0) << there.out;
  EXPECT_NE(there.out.find("Hello, world!"), std::string::npos) << there.out;
  EXPECT_NE(there.out.find("Status: install ok installed"), std::string::npos) << there.out;
  EXPECT_NE(there.out.find("bob"), std::string::npos) << there.out;
}

TEST(Boundary, CreateWithAMissingImageIsA404NamingIt) {
  Cluster c;
  auto r = c.cli("create --image no-such-image -- /bin/true");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE((r.out + r.err).find("no image 'no-such-image'"), std::string::npos) << r.out << r.err;
  EXPECT_NE((r.out + r.err).find("`sandgate image ls` lists the images"), std::string::npos) << r.out << r.err;
  auto raw = c.api_raw("POST", "/v1/sandboxes", R"({"command": ["/bin/true"], "image": "no-such-image"})");
  EXPECT_EQ(Cluster::http_code(raw), 404) << raw.out;
}

TEST(Boundary, WithoutTheDefaultImageCreateSaysHowToMakeIt) {
  Cluster c(ClusterOptions::node("images_dir = \"\"\ndefault_image = \"default\"\n"));
  auto r = c.cli("create -- /bin/true");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE((r.out + r.err).find("sandgate image build default"), std::string::npos) << r.out << r.err;
}

}  // namespace
}  // namespace sg::e2e
