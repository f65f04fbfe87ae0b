// The agent's SSH server (libssh): `ssh NAME` into any sandbox without an sshd in its image (docs/ssh.md).
//
// The agent listens on its SSH port before it says it is ready, then forks one listener process that
// accepts connections and forks one process per connection, so a crash or a hang stays in one session and
// the agent's HTTP side (libuv, threads) never forks into libssh. A connection authenticates with a public
// key listed in the node's authorized_keys file (read afresh by every connection, so `sandgate ssh-keys`
// takes effect at once) and then serves session channels (shell with or without a pty, exec, the sftp
// subsystem through the image's sftp-server, else the agent's own, agent/sftp_server.h) and direct-tcpip
// channels (`ssh -L`) to addresses the sandbox can reach. Every session runs as the sandbox's root, whatever user name the client gave.
#pragma once

#include <sys/types.h>

#include <string>

#include "common/error.h"

namespace sg::agent {

struct SshServerOptions {
  std::string host_key_file;         // OpenSSH private key (the node's per-sandbox ed25519 host key)
  std::string authorized_keys_file;  // the node's registered keys, one OpenSSH public key line each
  int auth_timeout_secs = 30;        // key exchange plus authentication, then the connection is dropped
  int max_auth_attempts = 6;         // public keys tried (OpenSSH's MaxAuthTries default)
  size_t max_sessions = 64;          // connection processes at once; beyond, a new connection is closed
};

// Fork the listener process serving `listen_fd` (already listening). Returns its pid. The listener dies
// with the calling process (PR_SET_PDEATHSIG); running connection processes do not.
Result<pid_t> start_ssh_listener(int listen_fd, const SshServerOptions& opts);

// The sftp-server the sftp subsystem runs: the first of OpenSSH's usual paths that is executable in the
// image, or "" when it has none (the agent then serves SFTP itself: `sandgate-agent --sftp-server`).
std::string find_sftp_server();

}  // namespace sg::agent
