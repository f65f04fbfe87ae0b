// Where the CLI's settings come from. Each is taken from the first of: its flag, its environment variable
// and, for the ingress (ssh-config, ssh-proxy), the ingress file next to the node socket, then a default.
// The ingress file is how the CLI learns where sandgate-proxy listens the same way it learns the API: whoever
// started the node writes it (deploy/quickstart.sh does), and SANDGATE_API already names its directory.
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include "common/api_client.h"
#include "common/error.h"

namespace sg::cli {

// Reads an environment variable, "" when unset. The CLI passes process_environment(); tests their own.
using Environment = std::function<std::string(const char* name)>;
Environment process_environment();

// The first non-empty of `flag`, env(name) and `fallback`.
std::string setting(const std::string& flag, const Environment& env, const char* name, std::string_view fallback);

// A small regular file's whole text (not through a symlink: these files hold secrets or end up in
// ssh_config). kNotFound when it does not exist, kInvalidArgument when larger than max_bytes.
Result<std::string> read_small_file(const std::string& path, size_t max_bytes);

inline constexpr std::string_view kIngressFileName = "ingress";
// "<directory of the socket>/ingress" for a unix: API address; "" for http:// and https://, which name no
// directory (an https API names the ingress itself).
std::string ingress_file_path(const ApiAddress& api);

struct IngressSettings {
  std::string ingress;  // HOST:PORT of sandgate-proxy
  std::string cacert;   // CA file for its certificate; "" = the system's trust store
  std::string domain;   // the sandbox domain
};

// The ingress file: "key=value" lines with the keys ingress, cacert (an absolute path) and domain, '#'
// comments and blank lines. Keys it does not know are skipped, so an older CLI still reads a newer file.
// kInvalidArgument naming path:line for a malformed line or value. Unset keys stay "".
Result<IngressSettings> parse_ingress_file(std::string_view text, const std::string& path);

struct ResolvedIngress {
  IngressSettings settings;
  // Where `settings.ingress` came from, for messages: "--ingress", "SANDGATE_INGRESS", the file's path, or
  // "" for the built-in default.
  std::string ingress_from;
};

// ingress, cacert and domain each from the first of: `flags` (non-empty fields), SANDGATE_INGRESS /
// SANDGATE_CACERT / SANDGATE_DOMAIN, the ingress file at `file` ("" or absent: skipped; unreadable or
// malformed: an error), then kDefaultIngress, the system's trust store, kDefaultDomain.
Result<ResolvedIngress> resolve_ingress(const IngressSettings& flags, const Environment& env, const std::string& file);

}  // namespace sg::cli
