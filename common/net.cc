#include "common/net.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>

#include <cerrno>
#include <cstddef>
#include <charconv>
#include <cstring>

namespace sg {

std::string Endpoint::to_string() const {
  if (kind == Kind::kUnix) return "unix:" + path;
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

Result<Endpoint> parse_endpoint(std::string_view text) {
  Endpoint ep;
  if (text.starts_with("unix:")) {
    ep.kind = Endpoint::Kind::kUnix;
    ep.path = std::string(text.substr(5));
    if (ep.path.empty()) return fail(Error::kInvalidArgument, "empty unix socket path");
    if (ep.path.size() >= sizeof(sockaddr_un::sun_path))
      return fail(Error::kInvalidArgument, "unix socket path too long: " + ep.path);
    return ep;
  }
  std::string_view host, port;
  if (text.starts_with("[")) {
    auto close = text.find(']');
    if (close == std::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':')
      return fail(Error::kInvalidArgument, "expected [addr]:port, got '" + std::string(text) + "'");
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else {
    auto colon = text.rfind(':');
    if (colon == std::string_view::npos)
      return fail(Error::kInvalidArgument, "expected host:port or unix:/path, got '" + std::string(text) + "'");
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  unsigned value = 0;
  auto [ptr, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (ec != std::errc() || ptr != port.data() + port.size() || value > 65535 || port.empty())
    return fail(Error::kInvalidArgument, "invalid port in '" + std::string(text) + "'");
  ep.port = static_cast<uint16_t>(value);
  ep.host = host == "localhost" ? "127.0.0.1" : std::string(host);
  in6_addr a6;
  in_addr a4;
  if (inet_pton(AF_INET, ep.host.c_str(), &a4) != 1 && inet_pton(AF_INET6, ep.host.c_str(), &a6) != 1)
    return fail(Error::kInvalidArgument, "not a numeric IP address: '" + std::string(host) + "'");
  return ep;
}

Result<SockAddr> to_sockaddr(const Endpoint& ep) {
  SockAddr sa;
  if (ep.kind == Endpoint::Kind::kUnix) {
    auto* un = reinterpret_cast<sockaddr_un*>(&sa.storage);
    un->sun_family = AF_UNIX;
    std::memcpy(un->sun_path, ep.path.c_str(), ep.path.size() + 1);
    sa.len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + ep.path.size() + 1);
    return sa;
  }
  auto* in4 = reinterpret_cast<sockaddr_in*>(&sa.storage);
  if (inet_pton(AF_INET, ep.host.c_str(), &in4->sin_addr) == 1) {
    in4->sin_family = AF_INET;
    in4->sin_port = htons(ep.port);
    sa.len = sizeof(sockaddr_in);
    return sa;
  }
  auto* in6 = reinterpret_cast<sockaddr_in6*>(&sa.storage);
  if (inet_pton(AF_INET6, ep.host.c_str(), &in6->sin6_addr) == 1) {
    in6->sin6_family = AF_INET6;
    in6->sin6_port = htons(ep.port);
    sa.len = sizeof(sockaddr_in6);
    return sa;
  }
  return fail(Error::kInvalidArgument, "bad address " + ep.host);
}

std::string format_peer(const sockaddr* sa) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (sa->sa_family == AF_INET) {
    // By hand: every accepted connection is named this way, and glibc's inet_ntop formats IPv4 with sprintf.
    auto* in4 = reinterpret_cast<const sockaddr_in*>(sa);
    const auto* octets = reinterpret_cast<const unsigned char*>(&in4->sin_addr);
    std::string out;
    out.reserve(21);  // "255.255.255.255:65535"
    const auto decimal = [&out](unsigned v) {
      char digits[5];
      int n = 0;
      do digits[n++] = static_cast<char>('0' + v % 10);
      while ((v /= 10) != 0);
      while (n > 0) out += digits[--n];
    };
    for (int i = 0; i < 4; ++i) {
      if (i > 0) out += '.';
      decimal(octets[i]);
    }
    out += ':';
    decimal(ntohs(in4->sin_port));
    return out;
  }
  if (sa->sa_family == AF_INET6) {
    auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    inet_ntop(AF_INET6, &in6->sin6_addr, buf, sizeof buf);
    return "[" + std::string(buf) + "]:" + std::to_string(ntohs(in6->sin6_port));
  }
  if (sa->sa_family == AF_UNIX) return "unix";
  return "?";
}

Result<UniqueFd> listen_on(const Endpoint& ep, bool reuse_port, int backlog) {
  auto sa = to_sockaddr(ep);
  if (!sa) return sa.failure();
  int family = sa->storage.ss_family;
  UniqueFd fd(::socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return fail_errno("socket", errno);
  int one = 1;
  if (family == AF_UNIX) {
    ::unlink(ep.path.c_str());  // a stale socket file from a previous run
  } else {
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (reuse_port && ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEPORT, &one, sizeof one) != 0)
      return fail_errno("setsockopt(SO_REUSEPORT)", errno);
    if (family == AF_INET6) ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
  }
  if (::bind(fd.get(), sa->get(), sa->len) != 0) return fail_errno("bind " + ep.to_string(), errno);
  if (::listen(fd.get(), backlog) != 0) return fail_errno("listen " + ep.to_string(), errno);
  return fd;
}

Result<UniqueFd> connect_blocking(const Endpoint& ep, int timeout_ms) {
  auto sa = to_sockaddr(ep);
  if (!sa) return sa.failure();
  UniqueFd fd(::socket(sa->storage.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return fail_errno("socket", errno);
  if (::connect(fd.get(), sa->get(), sa->len) != 0) {
    if (errno != EINPROGRESS) return fail_errno("connect " + ep.to_string(), errno);
    pollfd p{fd.get(), POLLOUT, 0};
    int n = ::poll(&p, 1, timeout_ms);
    if (n == 0) return fail(Error::kTimeout, "connect " + ep.to_string() + ": timed out");
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) return fail_errno("connect " + ep.to_string(), err);
  }
  int flags = ::fcntl(fd.get(), F_GETFL);
  ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

Result<uint16_t> local_port(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return fail_errno("getsockname", errno);
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  return fail(Error::kInvalidArgument, "not an IP socket");
}

Result<size_t> send_with_fds(int sock, const void* data, size_t len, std::span<const int> fds) {
  if (fds.size() > kMaxPassedFds) return fail(Error::kInvalidArgument, "too many descriptors for one message");
  iovec iov{const_cast<void*>(data), len};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxPassedFds)] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  ssize_t n;
  do {
    n = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return fail_errno("sendmsg", errno);
  return static_cast<size_t>(n);
}

Result<size_t> recv_with_fds(int sock, void* buf, size_t len, std::vector<UniqueFd>* received, bool* would_block) {
  *would_block = false;
  iovec iov{buf, len};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxPassedFds)] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t n;
  do {
    n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      *would_block = true;
      return size_t{0};
    }
    return fail_errno("recvmsg", errno);
  }
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      UniqueFd owned(fd);
      if (received->size() < kMaxPassedFds) received->push_back(std::move(owned));
    }
  }
  return static_cast<size_t>(n);
}

}  // namespace sg
