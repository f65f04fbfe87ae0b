// SSH into a sandbox that runs no sshd (docs/ssh.md): OpenSSH's ssh, scp, sftp and ssh -L, configured by
// `sandgate ssh-config` and keyed by `sandgate ssh-keys`, through `sandgate ssh-proxy` and the ingress to the
// agent's SSH server. The clients get a temp HOME and their own known_hosts, never the machine's.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

TEST(AgentSsh, SshScpSftpAndForwardingIntoASandboxWithoutSshd) {
  Cluster c;
  SshKeys keys = make_ssh_keys(c);
  auto added = c.cli("ssh-keys add --name tester " + shell_quote(keys.good + ".pub"));
  ASSERT_EQ(added.exit_code, 0) << added.out << added.err;
  EXPECT_NE(added.out.find("added tester (ssh-ed25519 SHA256:"), std::string::npos) << added.out;
  auto listed = c.cli("ssh-keys ls");
  EXPECT_NE(listed.out.find("tester"), std::string::npos) << listed.out;
  // A private key is not a public key; the node says so and registers nothing.
  auto not_pub = c.cli("ssh-keys add " + shell_quote(keys.bad));
  EXPECT_EQ(not_pub.exit_code, 1);
  EXPECT_NE(not_pub.err.find("not an SSH public key"), std::string::npos) << not_pub.err;

  // The sandbox's own command is a web server on its loopback only (the target of ssh -L); no sshd.
  auto j = create_with_agent(c, "nosshd", "-- python3 -m http.server 8123 --bind 127.0.0.1 --directory /sandgate-tests");
  ASSERT_TRUE(j.contains("id")) << j.dump();
  const std::string id = j["id"];
  const std::string config = c.dir() + "/ssh_config";
  auto block = c.cli("ssh-config nosshd --ingress 127.0.0.1:" + std::to_string(c.port()) + " --cacert " + c.ca());
  ASSERT_EQ(block.exit_code, 0) << block.err;
  write_file(config, block.out);

  // known_hosts written by the test from the host key the node keeps for the sandbox: StrictHostKeyChecking
  // =yes then proves the agent presents exactly that key.
  const std::string known_hosts = keys.dir + "/known_hosts";
  write_file(known_hosts, known_hosts_line(c, "nosshd", id));
  const std::string ssh = ssh_client(c, "ssh", config, keys.good, known_hosts);

  // A command: its stdout, its stderr and its exit status come back apart.
  auto cmd = run(ssh + " nosshd 'echo out $((6*7)); echo err >&2; exit 7'", 60);
  EXPECT_EQ(cmd.exit_code, 7) << cmd.err;
  EXPECT_EQ(cmd.out, "out 42\n");
  EXPECT_NE(cmd.err.find("err"), std::string::npos) << cmd.err;

  // A shell on a pty, driven by a script on stdin.
  auto shell = run("printf 'tty; echo pty-$((6*7))\\nexit 3\\n' | " + ssh + " -tt nosshd", 60);
  EXPECT_EQ(shell.exit_code, 3) << shell.out << shell.err;
  EXPECT_NE(shell.out.find("/dev/pts/"), std::string::npos) << shell.out;
  EXPECT_NE(shell.out.find("pty-42"), std::string::npos) << shell.out;

  // scp (OpenSSH 9's scp speaks SFTP) 10 MiB each way, compared by hash.
  const std::string scp = ssh_client(c, "scp -q", config, keys.good, known_hosts);
  const std::string up = c.dir() + "/up.bin";
  ASSERT_EQ(run("head -c 10485760 /dev/urandom > " + shell_quote(up)).exit_code, 0);
  // `up` to /root/NAME in the sandbox and back to NAME.down here, each side hashed.
  auto scp_both_ways = [&](const std::string& name) {
    auto put = run(scp + " " + shell_quote(up) + " nosshd:/root/" + name, 120);
    ASSERT_EQ(put.exit_code, 0) << put.err;
    EXPECT_EQ(sha256_file(c.dir() + "/node/sandboxes/" + id + "/upper/root/" + name), sha256_file(up));
    const std::string down = c.dir() + "/" + name + ".down";
    auto get = run(scp + " nosshd:/root/" + name + " " + shell_quote(down), 120);
    ASSERT_EQ(get.exit_code, 0) << get.err;
    EXPECT_EQ(sha256_file(down), sha256_file(up));
  };
  ASSERT_NO_FATAL_FAILURE(scp_both_ways("up.bin"));

  // sftp in batch mode: mkdir, put, rename, ls, get.
  auto sftp_batch = [&](const std::string& name, const std::string& commands) {
    write_file(c.dir() + "/" + name, commands);
    return run(ssh_client(c, "sftp", config, keys.good, known_hosts) + " -b " + shell_quote(c.dir() + "/" + name) +
                   " nosshd",
               60);
  };
  write_file(c.dir() + "/small.txt", "hello sftp\n");
  auto sftp = sftp_batch("batch", "mkdir /root/d\nput " + c.dir() + "/small.txt /root/d/a.txt\n" +
                                      "rename /root/d/a.txt /root/d/b.txt\nls /root/d\nget /root/d/b.txt " +
                                      c.dir() + "/back.txt\n");
  EXPECT_EQ(sftp.exit_code, 0) << sftp.out << sftp.err;
  EXPECT_NE(sftp.out.find("/root/d/b.txt"), std::string::npos) << sftp.out;
  EXPECT_EQ(read_file(c.dir() + "/back.txt"), "hello sftp\n");

  // An image without OpenSSH's sftp-server (a python:slim or busybox one): the agent serves SFTP itself.
  auto removed = run(ssh + " nosshd 'rm -f /usr/lib/openssh/sftp-server /usr/libexec/openssh/sftp-server "
                               "/usr/libexec/sftp-server /usr/lib/ssh/sftp-server /usr/lib/sftp-server'",
                     60);
  ASSERT_EQ(removed.exit_code, 0) << removed.err;
  ASSERT_NO_FATAL_FAILURE(scp_both_ways("up2.bin"));
  auto own = sftp_batch("batch2", "put " + c.dir() + "/small.txt /root/d/c.txt\nls -l /root/d\nget /root/d/c.txt " +
                                      c.dir() + "/back2.txt\n");
  EXPECT_EQ(own.exit_code, 0) << own.out << own.err;
  EXPECT_EQ(read_file(c.dir() + "/back2.txt"), "hello sftp\n");
  // The agent's server prints owners as numbers where OpenSSH's prints "root": this is the agent's.
  EXPECT_NE(own.out.find(" 0        0 "), std::string::npos) << own.out;

  // ssh -L to the web server on the sandbox's loopback.
  const uint16_t local = static_cast<uint16_t>(20000 + ::getpid() % 20000);
  Daemon forward;
  // exec: the Daemon's pid is ssh's own, so stop() ends ssh and not just a shell around it.
  ASSERT_TRUE(forward.start({"/bin/sh", "-c",
                             "exec " + ssh + " -N -o ExitOnForwardFailure=yes -L 127.0.0.1:" + std::to_string(local) +
                                 ":127.0.0.1:8123 nosshd"},
                            c.dir() + "/forward.log"));
  std::string page;
  EXPECT_TRUE(eventually(
      [&] {
        auto r = run("curl -s --max-time 5 http://127.0.0.1:" + std::to_string(local) + "/sshd_config", 10);
        page = r.out;
        return r.exit_code == 0 && page == read_file(source("tests/e2e/tools/sshd_config"));
      },
      std::chrono::seconds(20)))
      << page << forward.log();
  forward.stop();

  // rsync over ssh both ways (deploy/install-deps.sh installs it here, make-test-image.sh in the image: rsync
  // runs its own rsync at the other end, over the channel's command).
  const std::string rsync = "env HOME=" + shell_quote(c.home()) + " rsync -e " +
                            shell_quote(ssh_client(c, "ssh", config, keys.good, known_hosts)) + " ";
  auto rs = run(rsync + shell_quote(up) + " nosshd:/root/rsynced.bin", 120);
  EXPECT_EQ(rs.exit_code, 0) << rs.err;
  EXPECT_EQ(sha256_file(c.dir() + "/node/sandboxes/" + id + "/upper/root/rsynced.bin"), sha256_file(up));
  auto back = run(rsync + "nosshd:/root/rsynced.bin " + shell_quote(c.dir() + "/rsynced-back.bin"), 120);
  EXPECT_EQ(back.exit_code, 0) << back.err;
  EXPECT_EQ(sha256_file(c.dir() + "/rsynced-back.bin"), sha256_file(up));

  // A key nobody registered: OpenSSH's own refusal.
  auto refused = run(ssh_client(c, "ssh", config, keys.bad, known_hosts) + " nosshd true", 60);
  EXPECT_EQ(refused.exit_code, 255);
  EXPECT_NE(refused.err.find("Permission denied (publickey)"), std::string::npos) << refused.err;

  // The host key is the same after a suspend (the connection wakes the sandbox) and after a node restart.
  ASSERT_EQ(c.cli("suspend nosshd").exit_code, 0);
  ASSERT_EQ(c.get("nosshd")["state"], "suspended");
  auto woke = run(ssh + " nosshd 'echo awake'", 60);
  EXPECT_EQ(woke.exit_code, 0) << woke.err;
  EXPECT_EQ(woke.out, "awake\n");
  c.stop_node(SIGKILL);  // SIGTERM would terminate the sandboxes; a killed node adopts them when it starts
  c.start_node();
  ASSERT_TRUE(eventually([&] { return run(ssh + " nosshd true", 30).exit_code == 0; }, std::chrono::seconds(20)))
      << run(ssh + " nosshd true", 30).err;

  // A removed key is refused from the next connection on, with nothing restarted.
  ASSERT_EQ(c.cli("ssh-keys rm tester").exit_code, 0);
  auto gone = run(ssh + " nosshd true", 60);
  EXPECT_EQ(gone.exit_code, 255);
  EXPECT_NE(gone.err.find("Permission denied (publickey)"), std::string::npos) << gone.err;
}

// An open session counts as activity (the proxy's byte counts): a sandbox with a 2 s idle timeout stays
// running through a 5 s command, which would be cut ("sandbox_suspended") if it were suspended under it.
TEST(AgentSsh, AnOpenSessionKeepsTheSandboxAwake) {
  Cluster c;
  SshKeys keys = make_ssh_keys(c);
  ASSERT_EQ(c.cli("ssh-keys add " + shell_quote(keys.good + ".pub")).exit_code, 0);
  auto j = create_with_agent(c, "held", "--timeout 2 -- sleep infinity");
  ASSERT_TRUE(j.contains("id")) << j.dump();
  const std::string config = c.dir() + "/ssh_config";
  auto block = c.cli("ssh-config held --ingress 127.0.0.1:" + std::to_string(c.port()) + " --cacert " + c.ca());
  ASSERT_EQ(block.exit_code, 0) << block.err;
  write_file(config, block.out);
  const std::string ssh = ssh_client(c, "ssh", config, keys.good, keys.dir + "/known_hosts", "accept-new");
  auto r = run(ssh + " held 'sleep 5; echo still-here'", 60);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "still-here\n");
  // Closed: the idle clock starts and the sandbox suspends.
  EXPECT_TRUE(eventually([&] { return c.get("held")["state"] == "suspended"; }, std::chrono::seconds(15)));
}

}  // namespace
}  // namespace sg::e2e
