// Who may wake a sleeping sandbox with a TLS ClientHello alone. The proxy asks the node to start the wake as
// soon as the SNI names a sleeping sandbox, so the resume or restore runs while the handshake and the request
// head are still on their way (issue 12). A ClientHello carries no credential, though: anyone who knows a
// name could then keep sandboxes from sleeping. So the node starts such a wake only for a public port (any
// request to it wakes the sandbox anyway) or for a client address that opened the sandbox with a verified
// credential within a window (node.prewake_window_secs, read at each call so a reload applies at once). Every other client's first request wakes the sandbox as before, once its
// credential verified.
//
// Bounded: at most kMaxClientsPerSandbox addresses per sandbox (the oldest is replaced), entries go with
// their sandbox (forget), and nothing is stored for a request without an address. In memory only: after a
// node restart the first request of each client wakes as before.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace sg {

class PrewakeGate {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr size_t kMaxClientsPerSandbox = 16;

  // A credential of `client` verified for sandbox `id` (an open through the proxy).
  void verified(std::string_view id, std::string_view client, Clock::time_point now);
  // Whether a ClientHello from `client` may wake sandbox `id` (private port): it verified within `window`
  // (0: nobody).
  bool admits(std::string_view id, std::string_view client, Clock::time_point now, std::chrono::seconds window) const;
  // The sandbox is gone, or its token was rotated (the addresses had verified the old one).
  void forget(std::string_view id);
  // The operator token changed: an address may have verified with it.
  void clear() { seen_.clear(); }

  size_t sandboxes() const { return seen_.size(); }

 private:
  struct Seen {
    std::string client;
    Clock::time_point at;
  };
  std::unordered_map<std::string, std::vector<Seen>> seen_;
};

}  // namespace sg
