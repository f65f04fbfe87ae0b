#include "common/net.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <sys/un.h>

#include <string>

namespace sg {
namespace {

std::string ipv4_peer(const char* address, uint16_t port) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  EXPECT_EQ(inet_pton(AF_INET, address, &sa.sin_addr), 1) << address;
  return format_peer(reinterpret_cast<const sockaddr*>(&sa));
}

// The access log's "client" and the per-client limits' key: inet_ntop's form, with the port.
TEST(FormatPeer, NamesAnIpv4PeerAsInetNtopWouldWithItsPort) {
  EXPECT_EQ(ipv4_peer("127.0.0.1", 443), "127.0.0.1:443");
  EXPECT_EQ(ipv4_peer("0.0.0.0", 0), "0.0.0.0:0");
  EXPECT_EQ(ipv4_peer("255.255.255.255", 65535), "255.255.255.255:65535");
  EXPECT_EQ(ipv4_peer("10.200.3.40", 5060), "10.200.3.40:5060");
}

TEST(FormatPeer, NamesAnIpv6PeerInBracketsAndAUnixOneAsUnix) {
  sockaddr_in6 sa6{};
  sa6.sin6_family = AF_INET6;
  sa6.sin6_port = htons(8443);
  ASSERT_EQ(inet_pton(AF_INET6, "::1", &sa6.sin6_addr), 1);
  EXPECT_EQ(format_peer(reinterpret_cast<const sockaddr*>(&sa6)), "[::1]:8443");
  sockaddr_un un{};
  un.sun_family = AF_UNIX;
  EXPECT_EQ(format_peer(reinterpret_cast<const sockaddr*>(&un)), "unix");
}

}  // namespace
}  // namespace sg
