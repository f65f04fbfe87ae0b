// How many client connections the process's descriptor limit (RLIMIT_NOFILE) can carry. A connection that
// outgrows the limit fails somewhere in the middle (accept, the node's socket, a splice pipe) with EMFILE;
// refusing it at accept instead gives it a recorded cause (too_many_connections) and leaves headroom for the
// connections already open.
#pragma once

#include <cstdint>

#include "common/error.h"

namespace sg {

// Descriptors one connection can hold at its peak: the client socket, the sandbox socket, and while the node
// opens the sandbox a third (the node request). On the kTLS path two splice pipes (one per direction) of two
// ends each come after that request is gone, so 6 bounds both phases there; without kTLS no pipe is ever made
// and 3 do. Counting pipes a proxy cannot use would halve what a limit carries (65536: 10,912 connections
// instead of 21,824). A reload that makes kTLS possible later keeps the start's budget: a pipe that then
// finds no descriptor is a refused splice, and the connection is copied in userspace (ktls = "auto") or
// closed with ktls_required ("on").
inline constexpr uint64_t kFdsPerConnection = 3;
inline constexpr uint64_t kFdsPerSplicedConnection = 6;
inline constexpr uint64_t fds_per_connection(bool splice_pipes) {
  return splice_pipes ? kFdsPerSplicedConnection : kFdsPerConnection;
}
// Descriptors the process needs besides connections: stdio, the access log, per worker its listeners, loop
// (epoll, eventfds) and activity report socket, and files opened on reload (config, certificates, token).
inline constexpr uint64_t kReservedFds = 64;

// Connections a soft RLIMIT_NOFILE of `nofile` carries: (nofile - kReservedFds) / fds_per_connection(
// splice_pipes), at least 1 (a proxy that starts must be able to serve something; a tiny limit then fails at
// accept, which backs off). 1024 -> 320, or 160 with splice pipes (kTLS possible).
uint32_t max_connections_for_fd_limit(uint64_t nofile, bool splice_pipes);

// Spare sockets each of `workers` route caches may hold (proxy/route_cache.h): a sixteenth of the limit
// shared by the workers, at most RouteCache's default of 512 each. They come out of what connections get:
// max_connections_for_fd_limit(nofile - workers * spares). 1024 with 2 workers -> 32 each.
uint32_t spare_sockets_for_fd_limit(uint64_t nofile, unsigned workers);

struct FdLimit {
  uint64_t soft = 0;
  uint64_t hard = 0;
};

// Raises the soft RLIMIT_NOFILE to the hard one (the default soft limit, 1024, is far below what a busy
// ingress needs, and a process may raise it up to the hard limit itself) and returns the limit in force.
// A hard limit of "unlimited" cannot be a soft NOFILE limit (the kernel caps it at fs.nr_open): the soft one
// then stays. Errors only when the limit cannot even be read.
Result<FdLimit> raise_fd_limit();

}  // namespace sg
