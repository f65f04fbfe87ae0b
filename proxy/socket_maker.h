// The socket maker: makes sockets in a sandbox's network namespace for a route cache while sandgate-node is
// down, so a running sandbox keeps taking new connections through a node outage beyond the spares its route
// held (proxy/route_cache.h). Entering a network namespace takes CAP_SYS_ADMIN, which the proxy gives up
// with root; the maker is the one process beside it that keeps it.
//
// The proxy starts it as root, before it drops root, by running its own binary again
// (`sandgate-proxy --socket-maker ...`): a new process image, so none of the proxy's memory (its private
// keys, session ticket keys, tokens) is in it. The maker then
//   - closes every descriptor but one SOCK_SEQPACKET socket per worker, and dies with the proxy
//     (PR_SET_PDEATHSIG, set after the uid switch that clears it; it also exits once every worker's end is
//     closed); its environment is empty;
//   - keeps CAP_SYS_ADMIN alone (bounding set, permitted and effective; none inheritable or ambient), switches
//     to proxy.user's uid and gid (no supplementary groups), and sets no_new_privs.
// A request is {version, count} with one descriptor attached: a network namespace. The maker enters it,
// makes a socket whose namespace cookie must name sandgate-node's mark (common/vouched_netns.h; else it
// answers EACCES), makes the rest of `count` (1..kMaxSpareSockets) unconnected AF_INET stream sockets,
// returns to its own namespace and sends them back: {0 or an errno, count} with the sockets. A proxy gets
// nothing this way it could not get without it: sockets in the namespaces of running sandboxes, whose
// spares the node sent it.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/fd.h"
#include "proxy/route_cache.h"

namespace sg {

// One worker's end: make() is synchronous (one round trip to a process that only makes sockets, 0.17-0.2
// ms for 16 by bench/socket_maker.py), and only runs while the node is down. An answer later than
// kAnswerTimeoutMs (a stopped maker) ends this end for good: a late answer must never be read as the next
// request's.
class SocketMakerClient final : public SocketSource {
 public:
  static constexpr int kAnswerTimeoutMs = 1000;
  explicit SocketMakerClient(UniqueFd end) : end_(std::move(end)) {}
  Result<std::vector<UniqueFd>> make(int netns, size_t count) override;

 private:
  Failure give_up(Failure why);  // closes end_, logs once
  UniqueFd end_;
  uint64_t refusals_ = 0;
};

struct SocketMaker {
  pid_t pid = -1;
  std::vector<std::unique_ptr<SocketMakerClient>> clients;  // one per worker
};

// Starts the maker for `workers` workers as `uid`:`gid` (the process's own when not switching), entering
// only namespaces vouched for in `vouched_dir` (common/vouched_netns.h), and checks that each end answers.
// Needs root; kPermissionDenied otherwise. `executable`: the sandgate-proxy binary to run (a test's is not
// the one running).
Result<SocketMaker> start_socket_maker(size_t workers, uid_t uid, gid_t gid, const std::string& vouched_dir,
                                       const std::string& executable = "/proc/self/exe");

// `sandgate-proxy --socket-maker UID GID PARENT_PID FD...`: the maker's main (argv as main's). Returns its
// exit status.
int socket_maker_main(int argc, char** argv);
inline constexpr const char* kSocketMakerFlag = "--socket-maker";

}  // namespace sg
