// The network namespaces sandgate-node vouches for, so that the proxy's socket maker (proxy/socket_maker.h)
// enters those and no others. The maker holds CAP_SYS_ADMIN and enters whatever namespace descriptor it is
// sent; a proxy that held a descriptor of another namespace on the host (a container's, a bind mount of
// `ip netns`, which any user may open) would otherwise get sockets inside it.
//
// The node marks each sandbox namespace it sends a proxy with an empty file named after the namespace's
// cookie (SO_NETNS_COOKIE: a 64-bit number the kernel never gives another namespace, unlike an inode
// number), in a directory beside its socket that only root writes (`<node_socket>.netns/`), and removes
// the mark when the sandbox stops running, gets a new token or goes (any route event about it); a node that
// starts empties the directory. Marks stay while the node is down, which is when the maker works; a mark
// left for a namespace that has since gone matches no other.
#pragma once

#include <cstdint>
#include <string>

#include "common/error.h"
#include "common/net.h"

namespace sg {

// "<node_socket's path>.netns"; "" when the node socket is not a unix socket (no maker then).
std::string vouched_netns_dir(const Endpoint& node_socket);

// The cookie of the network namespace socket `sock` lives in.
Result<uint64_t> netns_cookie(int sock);
// The mark's file name for the namespace of that cookie.
std::string netns_mark_name(uint64_t cookie);

// Whether `dir` and every directory above it are root's and writable by nobody else (or sticky, as /tmp
// is): no one but root can put a mark there or swap the directory for another. kPermissionDenied if not.
Status check_marks_dir(const std::string& dir);

// The maker's check, on a socket it just made inside the namespace it was sent: check_marks_dir, and a mark
// of root's for the socket's namespace. kPermissionDenied otherwise.
Status check_vouched(const std::string& dir, int sock);

}  // namespace sg
