// The QEMU guest's identity listener, in the agent (sandgate-agent --identity-listen): the node's identity
// line after every start, resume and restore (noderuntime/qemu_driver.h) is applied here, in the process
// that is already running, and answered at once:
//
//   "<epoch seconds> <sandbox id> <hostname> <seed hex> <host key b64|-> <authorized_keys b64|-> <sequence>
//    <secret>\n"
//
// A wake waits for the answer before it lets requests through, so the clock, the SSH files, the hostname, the
// RNG reseed and the id are all in place for the first request. The busybox script the init ran for each
// line (nc -ll -e) cost a fork and two execs per wake, about 60 ms of every memory-tier wake under TCG; this
// costs a few system calls. The script stays for images whose agent does not listen.
//
// Anything in the guest can connect, so a line is applied only when it carries this boot's secret (the
// root-only fw_cfg file, read again for each line: a guest restored from a memory snapshot checks its new
// QEMU's). The SSH files are written only from a line newer than the last one written (its sequence); each
// line carries all the keys. Steps, in order: the clock, the SSH files, the hostname, the reseed, the id.
// The answer is "ok\n", or "failed <what>\n" naming the first step that failed (the others still run).
// A line without the secret, malformed or over kMaxIdentityLineBytes gets no answer: its connection closes.
//
// The same port takes one other line, "sync <secret>\n", before a filesystem checkpoint copies the guest's
// disk: the agent writes out what the filesystems hold in memory (sync(2), on the agent's loop: the guest
// is about to stand still anyway) and answers "ok\n".
#pragma once

#include <uv.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_set>

#include "common/error.h"
#include "common/net.h"

namespace sg::agent {

inline constexpr size_t kMaxIdentityLineBytes = 4 << 20;  // the node's authorized_keys, base64, fit easily
inline constexpr const char* kIdentitySecretFwCfg = "/sys/firmware/qemu_fw_cfg/by_name/opt/sandgate/identity_secret/raw";

struct IdentityPaths {
  std::string secret_file = kIdentitySecretFwCfg;
  std::string id_file;            // where /health reads the id (agent/identity.h kIdentityFile)
  std::string ssh_host_key;       // "" = this guest serves no SSH: the key fields are ignored
  std::string ssh_authorized_keys;
};

// What one line asks for, parsed and checked (not yet applied).
struct IdentityLine {
  int64_t epoch = 0;
  std::string id, hostname, seed_hex;  // seed_hex "" for "-"
  std::string host_key, authorized_keys;  // decoded; "" for "-"
  bool has_host_key = false;
  uint64_t sequence = 0;
  std::string secret;
};
Result<IdentityLine> parse_identity_line(std::string_view line);

// The system calls applying a line, apart so a test can watch them without root.
class IdentitySystem {
 public:
  virtual ~IdentitySystem() = default;
  virtual Status set_clock(int64_t epoch);
  virtual Status set_hostname(const std::string& name);
  virtual Status reseed(const std::string& seed_hex);
  // Writes out what the filesystems hold in memory (sync(2)).
  virtual Status sync_filesystems();
};

class IdentityListener {
 public:
  IdentityListener(uv_loop_t* loop, IdentityPaths paths, IdentitySystem* system);
  ~IdentityListener();
  IdentityListener(const IdentityListener&) = delete;
  IdentityListener& operator=(const IdentityListener&) = delete;

  Status listen(const Endpoint& ep);
  uint16_t port() const { return port_; }
  void close();

  // Applies one line as a connection's would be; returns the answer ("" = none: the line is dropped).
  std::string apply(std::string_view line);

 private:
  struct Client;
  void on_connection();

  uv_loop_t* loop_;
  IdentityPaths paths_;
  IdentitySystem* system_;
  uv_tcp_t listener_{};
  bool listening_ = false;
  uint16_t port_ = 0;
  uint64_t last_keys_sequence_ = 0;
  std::unordered_set<Client*> clients_;  // connections whose line has not been answered
};

}  // namespace sg::agent
