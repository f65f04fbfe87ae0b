// SSH into a sandbox through the TLS ingress: `sandgate ssh-config` writes the ~/.ssh/config block and
// `sandgate ssh-proxy` is its ProxyCommand. ssh-proxy opens TLS to sandgate-proxy with SNI
// <port>-<name>.<domain>, asks for the port with an HTTP/1.1 CONNECT carrying the sandbox token, then relays
// stdin/stdout over the tunnel. Also here: where `sandgate create` saves tokens for ssh-proxy to find.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/tls_client.h"
#include "common/error.h"

namespace sg::cli {

inline constexpr std::string_view kDefaultIngress = "127.0.0.1:8443";
inline constexpr std::string_view kDefaultDomain = "sandbox.localhost";

// A sandbox reference that may appear in a host name, a file name and an ssh_config line: a valid sandbox
// name (noderuntime/names.h) or an id. kInvalidArgument otherwise, so nothing can inject a newline, a space,
// a '%' token or a path.
Status validate_ref(std::string_view ref);

// "D" made of DNS labels ([a-z0-9-], dots between).
Status validate_domain(std::string_view domain);

// `ssh-proxy HOST`: HOST is "<name>" (the domain comes from `default_domain`) or "<name>.<domain>".
struct SshHost {
  std::string name;
  std::string domain;
};
Result<SshHost> parse_ssh_host(std::string_view host, std::string_view default_domain);

struct SshConfigOptions {
  std::string name;
  std::string user = "root";
  std::string ingress = std::string(kDefaultIngress);
  std::string domain = std::string(kDefaultDomain);
  std::string cacert;    // passed on to ssh-proxy when set
  std::string exe_path;  // the absolute path of this sandgate binary
};
// The block for ~/.ssh/config. kInvalidArgument for anything that would not stay inside its own line or
// would change the meaning of ProxyCommand.
Result<std::string> ssh_config_block(const SshConfigOptions& opts);

// <config_home>/sandgate/tokens/<ref>, config_home being $XDG_CONFIG_HOME or ~/.config.
Result<std::string> default_config_home();
std::string token_file(const std::string& config_home, std::string_view ref);
// Creates the directories (0700) as needed and writes the token (file 0600, replaced atomically).
Status save_token(const std::string& config_home, std::string_view ref, std::string_view token);
// The saved token, whitespace-trimmed; kNotFound when there is none.
Result<std::string> load_token(const std::string& config_home, std::string_view ref);
// Deletes the saved token (`sandgate rm`: a deleted sandbox's token must not linger); none saved is fine.
Status remove_token(const std::string& config_home, std::string_view ref);

struct SshProxyOptions {
  Ingress ingress;
  std::string ingress_from;  // where `ingress` came from (see ResolvedIngress), named when it cannot be reached
  std::string cacert;  // empty: the system's trust store
  std::string token;
  std::string name;
  std::string domain;
  uint16_t port = 22;
  int connect_timeout_ms = 30'000;  // TCP connect, TLS handshake and the CONNECT answer together
};

// The SNI name: "<port>-<name>.<domain>".
std::string tunnel_host(const SshProxyOptions& opts);
// The exact CONNECT request ssh-proxy sends.
std::string connect_request(const SshProxyOptions& opts);
// What to do about the ingress refusing CONNECT with `status` (printed after its answer); "" when there is
// nothing better to say than the answer itself.
std::string connect_refusal_hint(int status, const SshProxyOptions& opts);

// Runs the tunnel: relays in_fd -> TLS and TLS -> out_fd until the server closes (after in_fd's EOF, which is
// sent as close_notify, the server's remaining bytes still arrive). Errors go to stderr. Returns the exit
// code: 0 after a clean end, 1 on any failure (including a CONNECT refused: its status line and body are
// printed).
int run_ssh_proxy(const SshProxyOptions& opts, int in_fd, int out_fd);

}  // namespace sg::cli
