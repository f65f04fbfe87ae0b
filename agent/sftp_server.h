// The agent's own SFTP server (protocol version 3 with OpenSSH's extensions), for images that have no
// OpenSSH sftp-server: `sftp NAME` and OpenSSH 9's `scp` (which speaks SFTP) work in any sandbox, a
// python:slim or busybox one included (docs/ssh.md).
//
// The SSH connection process runs it as `sandgate-agent --sftp-server`, a child on pipes like any command,
// so it is the sandbox's root in the sandbox's filesystem, as OpenSSH's sftp-server would be: it is no
// boundary. What it guards is itself: every packet is parsed against its length; a malformed request gets
// SSH_FX_BAD_MESSAGE, and a packet longer than `max_packet`, one without an id or one before INIT ends the
// session with a message on stderr, never a crash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "common/error.h"

namespace sg::agent {

struct SftpLimits {
  size_t max_packet = 256 * 1024;       // a request's length (OpenSSH's SFTP_MAX_MSG_LENGTH)
  size_t max_read = 255 * 1024;         // the data one READ answers at most; a longer ask is cut short
  size_t max_handles = 256;             // open files and directories at once; more is a failure status
  size_t names_per_readdir = 100;       // entries in one READDIR answer
};

// One SFTP session's state (its open handles), fed one request at a time.
class SftpSession {
 public:
  explicit SftpSession(SftpLimits limits = {});
  ~SftpSession();
  SftpSession(const SftpSession&) = delete;
  SftpSession& operator=(const SftpSession&) = delete;

  // `packet` is one request without its length prefix (type byte first). Returns the reply, also without
  // its length, or a failure when the session must end (a malformed request, a request before INIT).
  Result<std::string> handle(std::string_view packet);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Serves SFTP on in_fd/out_fd (blocking) until the client closes its side or breaks the protocol.
// Returns the process exit status: 0 at the client's EOF, 1 after a protocol error (logged to stderr).
int serve_sftp(int in_fd, int out_fd, const SftpLimits& limits = {});

}  // namespace sg::agent
