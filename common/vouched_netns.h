// The network namespaces sandgate-node vouches for, so that the proxy's socket maker (proxy/socket_maker.h)
// enters those and no others. The maker holds CAP_SYS_ADMIN and enters whatever namespace descriptor it is
// sent; a proxy that held a descriptor of another namespace on the host (a container's, a bind mount of
// `ip netns`, which any user may open) would otherwise get sockets inside it.
//
// The node marks each sandbox namespace it sends a proxy with an empty file named after the namespace's
// device and inode, in a directory beside its socket that only root writes (`<node_socket>.netns/`), and
// removes the mark when the sandbox stops running, gets a new token or goes (any route event about it); a
// node that starts empties the directory. Marks stay while the node is down, which is when the maker works.
// A namespace's inode is not reused while any descriptor of it is open, and the proxy holds one for every
// mark it can use.
#pragma once

#include <string>

#include "common/error.h"
#include "common/net.h"

namespace sg {

// "<node_socket's path>.netns"; "" when the node socket is not a unix socket (no maker then).
std::string vouched_netns_dir(const Endpoint& node_socket);

// The mark's file name for the namespace `netns_fd` refers to: "<st_dev>-<st_ino>". kInvalidArgument if it
// is not a network namespace (checked on the nsfs file system first, so a file of a FUSE mount is never
// asked an ioctl).
Result<std::string> netns_mark_name(int netns_fd);

// The maker's check: `netns_fd` is a network namespace and `dir` holds its mark, both owned by root and
// `dir` writable by root only. kPermissionDenied otherwise.
Status check_vouched(const std::string& dir, int netns_fd);

}  // namespace sg
