// sandgate-agent: runs inside every sandbox and serves exec, files and health to the SDK (agent/README.md).
//
//   sandgate-agent [--listen 0.0.0.0:9501] [--max-upload-bytes N] [--max-execs N] [--max-connections N]
//                  [--max-contexts N] [--python python3]
//                  [--ssh-listen ADDR:PORT --ssh-host-key FILE --ssh-authorized-keys FILE]
//                  [--identity-listen ADDR:PORT [--identity-secret-file FILE] [--identity-id-file FILE]]
//   sandgate-agent --reseed-rng HEX   (agent/identity.h)
//   sandgate-agent --sftp-server      (SFTP on stdin/stdout, agent/sftp_server.h)
//
// With --identity-listen it applies the QEMU guest's identity lines (agent/identity_listener.h); that
// listener is bound first, and failing to bind it is fatal, so the guest's init can fall back to its script.
//
// With --ssh-listen it also serves SSH there (agent/ssh_server.h, docs/ssh.md), from a listener process
// forked before the event loop exists.
// Prints "sandgate-agent ready on <addr:port>" once listening. SIGINT/SIGTERM: stop accepting, kill the
// commands still running (their whole process groups), close every connection, exit 0.
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdio>
#include <string>

#include "agent/identity.h"
#include "agent/identity_listener.h"
#include "agent/server.h"
#include "agent/sftp_server.h"
#include "agent/ssh_server.h"
#include "common/net.h"

namespace {

struct Daemon {
  uv_loop_t* loop = nullptr;
  sg::agent::AgentServer* server = nullptr;
  sg::agent::IdentityListener* identity = nullptr;
  uv_signal_t sigint{}, sigterm{};
  pid_t ssh_listener = 0;

  void stop() {
    // Open SSH sessions are processes of their own and end with the sandbox, not with the agent.
    if (ssh_listener > 0) ::kill(ssh_listener, SIGTERM);
    server->close();
    if (identity != nullptr) identity->close();
    for (uv_signal_t* s : {&sigint, &sigterm}) uv_close(reinterpret_cast<uv_handle_t*>(s), nullptr);
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"sandgate-agent: exec, files, run_code and health inside a sandbox, over HTTP/1.1 and h2c"};
  std::string listen = "0.0.0.0:9501";
  sg::agent::AgentLimits limits;
  app.add_option("--listen", listen, "address:port to listen on (port 0: any free port)")->capture_default_str();
  app.add_option("--max-upload-bytes", limits.max_upload_bytes, "largest PUT /files body")->capture_default_str();
  app.add_option("--max-execs", limits.max_execs, "commands running at once (429 beyond)")->capture_default_str();
  app.add_option("--max-connections", limits.max_connections, "open connections (closed at once beyond)")
      ->capture_default_str();
  app.add_option("--max-contexts", limits.code.max_contexts, "run_code interpreters at once (429 beyond)")
      ->capture_default_str();
  app.add_option("--python", limits.code.settings.python, "run_code's interpreter (looked up in PATH)")
      ->capture_default_str();
  std::string ssh_listen;
  sg::agent::SshServerOptions ssh;
  app.add_option("--ssh-listen", ssh_listen, "address:port of the SSH server (none without it)");
  app.add_option("--ssh-host-key", ssh.host_key_file, "the SSH host key (OpenSSH private key file)");
  app.add_option("--ssh-authorized-keys", ssh.authorized_keys_file, "public keys SSH accepts, re-read per connection");
  std::string identity_listen;
  sg::agent::IdentityPaths identity_paths;
  identity_paths.id_file = sg::agent::kIdentityFile;
  app.add_option("--identity-listen", identity_listen, "address:port for the node's identity lines (QEMU guests)");
  app.add_option("--identity-secret-file", identity_paths.secret_file, "the secret a line must carry")
      ->capture_default_str();
  app.add_option("--identity-id-file", identity_paths.id_file, "where the sandbox id goes")->capture_default_str();
  std::string reseed;
  app.add_option("--reseed-rng", reseed,
                 "reseed the kernel's RNG with these hex bytes and exit (the guest's init, after a restore)");
  bool sftp_server = false;
  app.add_flag("--sftp-server", sftp_server,
               "serve SFTP on stdin/stdout and exit (the SSH server's sftp subsystem, where the image has no "
               "sftp-server)");
  CLI11_PARSE(app, argc, argv);
  if (sftp_server) return sg::agent::serve_sftp(STDIN_FILENO, STDOUT_FILENO);
  if (!reseed.empty()) {
    sg::Status s = sg::agent::reseed_rng(reseed);
    if (!s) {
      std::fprintf(stderr, "sandgate-agent: reseed: %s\n", s.message().c_str());
      return 1;
    }
    std::fprintf(stderr, "sandgate-agent: kernel RNG reseeded with %zu bytes from the node (sandbox %s)\n",
                 reseed.size() / 2, sg::agent::sandbox_identity().c_str());
    return 0;
  }
  if (!ssh_listen.empty() && (ssh.host_key_file.empty() || ssh.authorized_keys_file.empty())) {
    std::fprintf(stderr, "sandgate-agent: --ssh-listen needs --ssh-host-key and --ssh-authorized-keys\n");
    return 2;
  }

  auto ep = sg::parse_endpoint(listen);
  if (!ep) {
    std::fprintf(stderr, "sandgate-agent: --listen: %s\n", ep.message().c_str());
    return 2;
  }
  // Writes to a client that went away, or to a command that closed its stdin, must fail with EPIPE.
  std::signal(SIGPIPE, SIG_IGN);

  Daemon d;
  if (!ssh_listen.empty()) {
    // Bound before "ready" is printed, so whoever waits for the agent can connect to SSH at once too.
    auto ssh_ep = sg::parse_endpoint(ssh_listen);
    if (!ssh_ep) {
      std::fprintf(stderr, "sandgate-agent: --ssh-listen: %s\n", ssh_ep.message().c_str());
      return 2;
    }
    // Not fatal: the sandbox's own program may hold the port, and exec and files must keep working then.
    auto fd = sg::listen_on(*ssh_ep, false, 64);
    auto pid = fd ? sg::agent::start_ssh_listener(fd->get(), ssh) : sg::Result<pid_t>(fd.failure());
    if (pid) d.ssh_listener = *pid;
    else std::fprintf(stderr, "sandgate-agent: no SSH server: %s\n", pid.message().c_str());
  }
  d.loop = uv_default_loop();
  sg::agent::IdentitySystem identity_system;
  if (!ssh_listen.empty()) {
    identity_paths.ssh_host_key = ssh.host_key_file;
    identity_paths.ssh_authorized_keys = ssh.authorized_keys_file;
  }
  sg::agent::IdentityListener identity(d.loop, identity_paths, &identity_system);
  if (!identity_listen.empty()) {
    auto identity_ep = sg::parse_endpoint(identity_listen);
    sg::Status bound = identity_ep ? identity.listen(*identity_ep) : sg::Status(identity_ep.failure());
    if (!bound) {
      std::fprintf(stderr, "sandgate-agent: --identity-listen: %s\n", bound.message().c_str());
      if (d.ssh_listener > 0) ::kill(d.ssh_listener, SIGTERM);
      return 1;
    }
    d.identity = &identity;
  }
  sg::agent::AgentServer server(d.loop, limits);
  d.server = &server;
  if (auto s = server.listen(*ep); !s) {
    std::fprintf(stderr, "sandgate-agent: %s\n", s.message().c_str());
    return 1;
  }
  for (auto [handle, signum] : {std::pair{&d.sigint, SIGINT}, std::pair{&d.sigterm, SIGTERM}}) {
    uv_signal_init(d.loop, handle);
    handle->data = &d;
    uv_signal_start(handle, [](uv_signal_t* h, int) { static_cast<Daemon*>(h->data)->stop(); }, signum);
  }
  std::printf("sandgate-agent ready on %s\n", server.address().c_str());
  std::fflush(stdout);
  // Returns once every connection has closed and every killed command has been reaped.
  uv_run(d.loop, UV_RUN_DEFAULT);
  uv_loop_close(d.loop);
  return 0;
}
