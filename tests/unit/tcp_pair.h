// Two ends of a real loopback TCP connection, for the tests of units that work on sockets (splice pipes,
// socket watches): `a` connected (blocking), `b` accepted (non-blocking). Shared by every unit-test binary.
#pragma once

#include <gtest/gtest.h>
#include <sys/socket.h>

#include <string>

#include "common/fd.h"
#include "common/net.h"

namespace sg::testing {

struct TcpPair {
  UniqueFd a;
  UniqueFd b;
};

inline TcpPair connected_tcp_pair() {
  auto listener = listen_on(*parse_endpoint("127.0.0.1:0"), false, 1);
  EXPECT_TRUE(listener);
  auto port = local_port(listener->get());
  auto a = connect_blocking(*parse_endpoint("127.0.0.1:" + std::to_string(*port)), 1000);
  EXPECT_TRUE(a);
  UniqueFd b(::accept4(listener->get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
  EXPECT_TRUE(b.valid());
  return {std::move(*a), std::move(b)};
}

}  // namespace sg::testing
