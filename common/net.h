// Socket helpers shared by the daemons and the CLI: address parsing, listeners, and passing a file
// descriptor with a message over a unix socket (how the node hands a sandbox-side socket to the proxy).
#pragma once

#include <sys/socket.h>
#include <sys/un.h>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/fd.h"

namespace sg {

// "127.0.0.1:8443", "[::1]:8443", "localhost:8443" (loopback only), or "unix:/path/to.sock".
struct Endpoint {
  enum class Kind { kTcp, kUnix } kind = Kind::kTcp;
  std::string host;  // numeric address for kTcp
  uint16_t port = 0;
  std::string path;  // for kUnix

  std::string to_string() const;
};

Result<Endpoint> parse_endpoint(std::string_view text);

struct SockAddr {
  sockaddr_storage storage{};
  socklen_t len = 0;
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&storage); }
};
Result<SockAddr> to_sockaddr(const Endpoint& ep);
// "1.2.3.4:5" / "[::1]:5" for the access log.
std::string format_peer(const sockaddr* sa);

// A non-blocking, close-on-exec listening socket. reuse_port lets each proxy worker own a listener.
Result<UniqueFd> listen_on(const Endpoint& ep, bool reuse_port, int backlog = 1024);
// Blocking connect with a timeout (used by the CLI and tests, never by the data path).
Result<UniqueFd> connect_blocking(const Endpoint& ep, int timeout_ms);
// The port a bound socket ended up on (for port 0 in tests).
Result<uint16_t> local_port(int fd);

// The most spare sockets the node sends on one message (internal/open, internal/sockets), so the most a
// proxy's route-cache refill asks for.
inline constexpr size_t kMaxSpareSockets = 64;
// The most descriptors one message carries: an open's socket, its spares and their network namespace.
inline constexpr size_t kMaxPassedFds = kMaxSpareSockets + 2;
// sendmsg() of `data` with `fds` (at most kMaxPassedFds) attached via SCM_RIGHTS. Returns bytes written (may
// be short; the descriptors travel with the first byte).
Result<size_t> send_with_fds(int sock, const void* data, size_t len, std::span<const int> fds);
// recvmsg() into buf; passed descriptors, if any, are appended to *received, at most kMaxPassedFds in all
// (more are closed: a peer cannot make us hold an unbounded number). Returns 0 at EOF; Error::kIo with
// EAGAIN in the message is never returned: *would_block is set instead.
Result<size_t> recv_with_fds(int sock, void* buf, size_t len, std::vector<UniqueFd>* received, bool* would_block);

}  // namespace sg
