// `sandgate`: the command line client of sandgate-node (docs/node-api.md).
// Exit codes: 0 success, 1 the node refused or could not be reached (its message on stderr), 2 usage error.
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <climits>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "common/api_client.h"
#include "cli/commands.h"
#include "cli/settings.h"
#include "cli/ssh.h"
#include "common/ssh_public_key.h"

namespace {

using nlohmann::json;
using sg::ApiClient;

constexpr int kExitOk = 0;
constexpr int kExitError = 1;
constexpr int kExitUsage = 2;

// Generous: deleting a sandbox waits for its processes to exit, creating one for its cgroup and init or for a
// VM to boot (which the driver may retry).
constexpr int kRequestTimeoutMs = 120'000;

int error(const std::string& message, int code = kExitError) {
  std::cerr << "sandgate: " << message << "\n";
  return code;
}

// The node API as this run reaches it, and what error messages need to know about it.
struct Node {
  ApiClient client;
  std::string where;        // api_address_string(), for messages
  bool sent_token = false;  // an operator token goes with every request (https API)

  // One request whose answer must be a 2xx JSON object. Failures are worded for the user: unreachable,
  // refused (kConflict for a 409: the sandbox's state forbids it) or not sandgate-node's answer.
  sg::Result<json> send(std::string_view command, std::string_view method, const std::string& path,
                        const json& body, std::string_view ref, std::string* raw = nullptr) const {
    auto res = client.request(method, path, body);
    if (!res) return res.failure();
    if (res->status < 200 || res->status > 299)
      return sg::fail(res->status == 409 ? sg::Error::kConflict : sg::Error::kUnavailable,
                      sg::cli::error_message(res->status, res->body, {command, ref, where, sent_token}));
    auto parsed = sg::cli::parse_object(res->body, where);
    if (parsed && raw != nullptr) *raw = std::move(res->body);
    return parsed;
  }
};

// Prints an answer: the node's JSON as it came with --json, else through `format`.
template <typename Format>
int print(const json& answer, const std::string& raw, bool raw_json, Format format) {
  if (raw_json) {
    std::cout << raw;
    if (raw.empty() || raw.back() != '\n') std::cout << "\n";
  } else {
    std::cout << format(answer);
  }
  std::cout.flush();
  return std::cout ? kExitOk : error("cannot write to stdout");
}

template <typename Format>
int call(const Node& node, std::string_view command, std::string_view method, const std::string& path,
         std::string_view ref, bool raw_json, Format format) {
  std::string raw;
  auto answer = node.send(command, method, path, nullptr, ref, &raw);
  if (!answer) return error(answer.message());
  return print(*answer, raw, raw_json, format);
}

// `sandgate image build`: the node's progress lines as they come, then the image or the failure (which names
// the step, its exit code and its last output lines).
int build_image(const Node& node, const sg::cli::ImageBuildOptions& opts) {
  std::error_code ec;
  std::string cwd = std::filesystem::current_path(ec).string();
  auto body = sg::cli::image_build_body(opts, cwd);
  if (!body) return error(body.message(), kExitUsage);
  // The stream lasts as long as the build: its timeout plus a margin for the node to answer.
  constexpr int kDefaultBuildSecs = 1800, kMarginSecs = 60;
  int timeout_ms = ((opts.timeout_secs != 0 ? static_cast<int>(opts.timeout_secs) : kDefaultBuildSecs) + kMarginSecs) * 1000;
  json last;
  auto res = node.client.stream("POST", "/v1/images/build", *body, timeout_ms, [&](std::string_view line) {
    json event = json::parse(line, nullptr, false);
    if (!event.is_object()) return;
    if (event.contains("image") || (event.contains("event") && event["event"] == "error")) {
      last = std::move(event);
      return;
    }
    std::cout << sg::cli::format_build_event(event);
    std::cout.flush();
  });
  if (!res) return error(res.message());
  if (res->status < 200 || res->status > 299)
    return error(sg::cli::error_message(res->status, res->body, {"image build", opts.name, node.where, node.sent_token}));
  if (last.is_object() && last.contains("image") && last["image"].is_object()) {
    std::cout << sg::cli::format_image_built(last["image"]);
    std::cout.flush();
    return std::cout ? kExitOk : error("cannot write to stdout");
  }
  if (last.is_object() && last.contains("message") && last["message"].is_string())
    return error("image build " + opts.name + ": " + last["message"].get<std::string>());
  return error("image build " + opts.name + ": the node closed the progress stream before the build ended (`sandgate "
               "image ls` shows whether it finished)");
}

// `sandgate suspend/resume`: a refusal because the sandbox has failed says so, with why and what to do; the
// node's own 409 only names the state.
int change_state(const Node& node, std::string_view action, std::string_view attempted, const std::string& ref) {
  auto answer = node.send(action, "POST", sg::cli::sandbox_path(ref, action), nullptr, ref);
  if (answer) return print(*answer, "", false, sg::cli::format_state_change);
  if (answer.error() == sg::Error::kConflict) {
    auto sandbox = node.send("get", "GET", sg::cli::sandbox_path(ref), nullptr, ref);
    if (sandbox)
      if (auto failed = sg::cli::failed_message(*sandbox, attempted)) return error(*failed);
  }
  return error(answer.message());
}

// The token in a create or rotate answer is shown this once: it is saved for ssh-proxy (replacing any
// older one of that sandbox).
void save_shown_token(const json& answer) {
  auto token = answer.find("token");
  if (token == answer.end() || !token->is_string()) return;
  std::string ref = sg::cli::sandbox_label(answer);
  auto home = sg::cli::default_config_home();
  sg::Status saved = home ? sg::cli::save_token(*home, ref, token->get<std::string>()) : sg::Status(home.failure());
  if (saved) {
    std::cerr << "sandgate: the token is shown only once; saved to " << sg::cli::token_file(*home, ref) << "\n";
  } else {
    std::cerr << "sandgate: the token is shown only once and could not be saved (" << saved.message()
              << "); keep it now\n";
  }
}

// `sandgate create`: like call(), and the token in the answer is saved for ssh-proxy and shown this once.
int create_sandbox(const Node& node, const json& body, std::string_view name, bool raw_json) {
  std::string raw;
  auto answer = node.send("create", "POST", "/v1/sandboxes", body, name, &raw);
  if (!answer) return error(answer.message());
  int printed = print(*answer, raw, raw_json, sg::cli::format_created);
  save_shown_token(*answer);
  // Its command may have ended before the node answered: a sandbox that is already gone is not a success.
  if (auto failed = sg::cli::failed_message(*answer, "")) return error(*failed);
  return printed;
}

// `sandgate fork`: the node makes the memory checkpoint and the forks (all or none of them); each fork's
// token is saved as create saves one.
int fork_sandbox(const Node& node, const std::string& ref, uint32_t count, const std::string& prefix, bool raw_json) {
  json body = {{"count", count}};
  if (!prefix.empty()) body["name_prefix"] = prefix;
  std::string raw;
  auto answer = node.send("fork", "POST", sg::cli::sandbox_path(ref, "fork"), body, ref, &raw);
  if (!answer) return error(answer.message());
  const json& forks = (*answer)["sandboxes"];
  if (forks.is_array())
    for (const json& sb : forks) save_shown_token(sb);
  return print(*answer, raw, raw_json, sg::cli::format_fork);
}

// `sandgate token rotate`: a new token replaces the old one at once (the node refuses the old one, and the
// proxies close the connections it opened); the new one is printed and saved.
int rotate_token(const Node& node, const std::string& ref, bool raw_json) {
  std::string raw;
  auto answer = node.send("token rotate", "POST", sg::cli::sandbox_path(ref, "token"), nullptr, ref, &raw);
  if (!answer) return error(answer.message());
  if (raw_json) {
    std::cout << raw << "\n";
  } else {
    std::cout << answer->value("token", "") << "\n";
  }
  save_shown_token(*answer);
  return 0;
}

// `sandgate rm`: the sandbox's saved token goes with it (a later sandbox of that name gets a new one).
int remove_sandbox(const Node& node, const std::string& ref) {
  auto answer = node.send("rm", "DELETE", sg::cli::sandbox_path(ref), nullptr, ref);
  if (!answer) return error(answer.message());
  std::string label = sg::cli::sandbox_label(*answer);
  auto home = sg::cli::default_config_home();
  sg::Status removed = home ? sg::cli::remove_token(*home, label) : sg::Status(home.failure());
  // The sandbox is gone either way; a token left behind opens nothing, so this is only a warning.
  if (!removed)
    std::cerr << "sandgate: warning: " << label << " is removed, but not its saved token (" << removed.message()
              << "); delete the file by hand\n";
  return print(*answer, "", false, sg::cli::format_state_change);
}

std::string self_path() {
  char buf[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Create and manage sandboxes on a sandgate-node.", "sandgate"};
  app.require_subcommand(1);
  // Subcommands inherit this, so global options such as --api also work after the subcommand name.
  app.fallthrough();
  app.set_version_flag("--version", "sandgate " + std::string(sg::cli::kVersion));

  std::string api(sg::kDefaultApi);
  app.add_option("--api", api,
                 "node API address: unix:/path, http://127.0.0.1:PORT, or https://api.DOMAIN[:PORT] through the "
                 "ingress (needs --token)")
      ->envname("SANDGATE_API")
      ->capture_default_str();
  // Global because both the https API and ssh-proxy go through the ingress; the environment is read below.
  std::string token, cacert, connect_to;
  app.add_option("--token", token,
                 "operator token for an https or http --api; for ssh-proxy, a sandbox or operator token (default: the "
                 "saved one) (env SANDGATE_TOKEN)");
  app.add_option("--cacert", cacert,
                 "CA file for the ingress's certificate (env SANDGATE_CACERT; for ssh-config and ssh-proxy also the "
                 "ingress file; default: the system's trust store)");
  app.add_option("--connect-to", connect_to,
                 "HOST:PORT to dial for an https --api instead of the URL's host; the certificate is still "
                 "checked against the URL's host (env SANDGATE_INGRESS)");

  bool raw_json = false;
  std::string ref;

  sg::cli::CreateOptions create_opts;
  std::string name, cwd;
  uint32_t timeout_secs = 0, memory_mb = 0, hibernate_after_secs = 0, pids_max = 0, disk_mb = 0;
  std::string driver, image;
  double cpus = 0;
  CLI::App* create = app.add_subcommand("create", "Create and start a sandbox running CMD");
  auto* name_opt = create->add_option("--name", name, "unique name (used in URLs); default: unnamed");
  create->add_flag("--ephemeral", create_opts.ephemeral, "ephemeral sandbox: cannot be suspended or resumed");
  auto* timeout_opt = create->add_option("--timeout", timeout_secs, "idle seconds before the sandbox is suspended");
  auto* hibernate_opt = create->add_option(
      "--hibernate-after", hibernate_after_secs,
      "seconds suspended in memory before it is hibernated to disk (0 = never; drivers that can hibernate)");
  auto* driver_opt =
      create->add_option("--driver", driver, "process, qemu, firecracker or cloud-hypervisor (default: the node's)");
  auto* image_opt = create->add_option("--image", image, "image of the root filesystem (default: the node's)");
  // One port per --expose: a greedy vector option would swallow the command when `--` is forgotten.
  create->add_option("--expose", create_opts.expose,
                     "PORT[/PROTO]: reachable at https://PORT-NAME.DOMAIN with the sandbox token; PROTO is http1 "
                     "(default), h2c or tcp (repeatable)")
      ->allow_extra_args(false);
  create->add_option("--public", create_opts.publish, "PORT[/PROTO]: like --expose, but needs no token (repeatable)")
      ->allow_extra_args(false);
  auto* cpus_opt = create->add_option("--cpus", cpus, "CPU limit, in CPUs (e.g. 0.5)");
  auto* memory_opt = create->add_option("--memory-mb", memory_mb, "memory limit in MiB");
  auto* disk_opt = create->add_option("--disk-mb", disk_mb, "most MiB the sandbox may write (default: node.default_disk_mb, no limit)");
  auto* pids_opt = create->add_option("--pids-max", pids_max, "most processes and threads at once (default: the node's)");
  bool internet = false, no_internet = false;
  auto* internet_opt = create->add_flag("--internet", internet, "outbound network access (default: the node's)");
  auto* no_internet_opt = create->add_flag("--no-internet", no_internet, "only the sandbox's own loopback");
  internet_opt->excludes(no_internet_opt);
  create->add_option("--allow-out", create_opts.allow_out,
                     "CIDR[:PORT]: with --internet, reach only these (repeatable)")
      ->allow_extra_args(false);
  create->add_option("--deny-out", create_opts.deny_out, "CIDR[:PORT]: with --internet, never reach these (repeatable)")
      ->allow_extra_args(false);
  create->add_option("--env", create_opts.env, "environment variable KEY=VALUE (repeatable)")
      ->allow_extra_args(false);
  auto* cwd_opt = create->add_option("--cwd", cwd, "working directory of CMD");
  create->add_flag("--json", raw_json, "print the node's JSON answer");
  std::string from;
  auto* from_opt = create->add_option("--from", from,
                                      "snapshot id (snap-...): start from its root filesystem, with its command, env, "
                                      "cwd and ports unless given");
  create->add_option("command", create_opts.command,
                     "the command and its arguments, after -- (with --from: default the snapshot's)");

  std::string checkpoint_type = "filesystem";
  CLI::App* checkpoint = app.add_subcommand(
      "checkpoint", "Checkpoint a running sandbox (it keeps running) and print the snapshot id");
  checkpoint->add_option("sandbox", ref, "name or id")->required();
  checkpoint->add_option("--type", checkpoint_type, "filesystem (the disk state; a QEMU sandbox needs an image disk) or memory (not on the process driver)")
      ->capture_default_str();
  checkpoint->add_flag("--json", raw_json, "print the node's JSON answer");
  uint32_t fork_count = 1;
  std::string fork_prefix;
  CLI::App* fork_cmd = app.add_subcommand(
      "fork", "Fork a running sandbox: a memory checkpoint, then COUNT sandboxes from it, its processes continuing "
              "in each (each its own id, token, hostname and RNG)");
  fork_cmd->add_option("sandbox", ref, "name or id")->required();
  fork_cmd->add_option("--count", fork_count, "how many sandboxes (at most 64)")->check(CLI::Range(1u, 64u))
      ->capture_default_str();
  fork_cmd->add_option("--name-prefix", fork_prefix,
                   "name them PREFIX-1 ... PREFIX-COUNT (default: the sandbox's name followed by -fork; none when "
                   "it has no name)");
  fork_cmd->add_flag("--json", raw_json, "print the node's JSON answer (the snapshot and the sandboxes)");
  std::string port_flag;
  bool expose_public = false;
  CLI::App* expose = app.add_subcommand(
      "expose", "Expose a port of a sandbox (or change how it is exposed) and print its URL");
  expose->add_option("sandbox", ref, "name or id")->required();
  expose->add_option("port", port_flag, "PORT[/PROTO]: PROTO is http1 (default), h2c or tcp")->required();
  expose->add_flag("--public", expose_public, "reachable without the sandbox token");
  expose->add_flag("--json", raw_json, "print the node's JSON answer (the sandbox)");
  CLI::App* unexpose = app.add_subcommand(
      "unexpose", "Close an exposed port: new connections to it are refused, open ones closed");
  unexpose->add_option("sandbox", ref, "name or id")->required();
  unexpose->add_option("port", port_flag, "PORT")->required();
  CLI::App* snapshots = app.add_subcommand("snapshots", "List snapshots");
  snapshots->add_flag("--json", raw_json, "print the node's JSON answer");
  CLI::App* snapshot_cmd = app.add_subcommand("snapshot", "Manage snapshots");
  snapshot_cmd->require_subcommand(1);
  CLI::App* snapshot_rm = snapshot_cmd->add_subcommand(
      "rm", "Remove a snapshot (refused while a sandbox created from it lives) and the layers nothing else uses");
  snapshot_rm->add_option("snapshot", ref, "snapshot id (snap-...)")->required();

  CLI::App* ssh_keys = app.add_subcommand("ssh-keys", "Manage the public keys `ssh NAME` accepts (every sandbox)");
  ssh_keys->require_subcommand(1);
  std::string key_file, key_label;
  CLI::App* ssh_keys_add = ssh_keys->add_subcommand("add", "Register a public key (a .pub file)");
  ssh_keys_add->add_option("file", key_file, "the public key file, e.g. ~/.ssh/id_ed25519.pub")->required();
  ssh_keys_add->add_option("--name", key_label, "its label (default: the key's comment)");
  ssh_keys_add->add_flag("--json", raw_json, "print the node's JSON answer");
  CLI::App* ssh_keys_ls = ssh_keys->add_subcommand("ls", "List the registered keys");
  ssh_keys_ls->add_flag("--json", raw_json, "print the node's JSON answer");
  CLI::App* ssh_keys_rm = ssh_keys->add_subcommand("rm", "Remove a key: new connections with it are refused");
  ssh_keys_rm->add_option("label", key_label, "its label (see ssh-keys ls)")->required();

  CLI::App* ls = app.add_subcommand("ls", "List sandboxes");
  ls->add_flag("--json", raw_json, "print the node's JSON answer");

  // A fleet ([fleet] on the node, docs/fleet.md).
  CLI::App* nodes = app.add_subcommand("nodes", "List the fleet's nodes with their state and load");
  nodes->add_flag("--json", raw_json, "print the node's JSON answer");
  CLI::App* node_cmd = app.add_subcommand("node", "Manage fleet nodes");
  node_cmd->require_subcommand(1);
  CLI::App* node_drain = node_cmd->add_subcommand("drain", "Mark a node draining: placement skips it");
  node_drain->add_option("node", ref, "node name")->required();
  node_drain->add_flag("--json", raw_json, "print the node's JSON answer (with the sandboxes that stay)");
  CLI::App* node_undrain = node_cmd->add_subcommand("undrain", "Mark a draining node ready again");
  node_undrain->add_option("node", ref, "node name")->required();

  CLI::App* get = app.add_subcommand("get", "Show one sandbox");
  get->add_option("sandbox", ref, "name or id")->required();
  get->add_flag("--json", raw_json, "print the node's JSON answer");

  CLI::App* suspend = app.add_subcommand("suspend", "Suspend a sandbox now (it wakes on the next request)");
  suspend->add_option("sandbox", ref, "name or id")->required();
  CLI::App* resume = app.add_subcommand("resume", "Resume a suspended sandbox");
  resume->add_option("sandbox", ref, "name or id")->required();
  CLI::App* rm = app.add_subcommand("rm", "Terminate and remove a sandbox");
  rm->add_option("sandbox", ref, "name or id")->required();
  CLI::App* token_cmd = app.add_subcommand("token", "Manage a sandbox's access token");
  token_cmd->require_subcommand(1);
  CLI::App* rotate = token_cmd->add_subcommand(
      "rotate", "Replace a sandbox's token: the old one is refused at once and its open connections are closed");
  rotate->add_option("sandbox", ref, "name or id")->required();
  rotate->add_flag("--json", raw_json, "print the node's JSON answer");

  std::string ingress, domain, ssh_user = "root";
  CLI::App* ssh_config = app.add_subcommand("ssh-config", "Print a ~/.ssh/config block for `ssh NAME`");
  ssh_config->add_option("sandbox", ref, "name or id")->required();
  ssh_config->add_option("--user", ssh_user, "user to log in as")->capture_default_str();
  ssh_config->add_option("--ingress", ingress,
                         "sandgate-proxy HOST:PORT (env SANDGATE_INGRESS; else the ingress file next to the node "
                         "socket; else 127.0.0.1:8443)");
  ssh_config->add_option("--domain", domain,
                         "sandbox domain (env SANDGATE_DOMAIN; else the ingress file; else sandbox.localhost)");

  uint16_t ssh_port = 22;
  CLI::App* ssh_proxy =
      app.add_subcommand("ssh-proxy", "Tunnel stdin/stdout to a sandbox port through the ingress (ssh ProxyCommand)");
  ssh_proxy->add_option("host", ref, "NAME or NAME.DOMAIN")->required();
  ssh_proxy->add_option("--ingress", ingress,
                        "sandgate-proxy HOST:PORT (env SANDGATE_INGRESS; else the ingress file next to the node "
                        "socket; else 127.0.0.1:8443)");
  ssh_proxy->add_option("--domain", domain,
                        "domain when HOST is a bare name (env SANDGATE_DOMAIN; else the ingress file)");
  ssh_proxy->add_option("--port", ssh_port, "sandbox port")->capture_default_str()->check(CLI::Range(1, 65535));

  std::string archive_file;
  CLI::App* image_cmd = app.add_subcommand("image", "Manage the node's images (root filesystems for sandboxes)");
  image_cmd->require_subcommand(1);
  CLI::App* image_import = image_cmd->add_subcommand(
      "import", "Import a `docker save` archive or an OCI image layout tar (a file on the node) as NAME");
  image_import->add_option("file", archive_file, "the archive, on the node's disk")->required();
  image_import->add_option("name", ref, "the image's name (A-Z a-z 0-9 . _ : -)")->required();
  image_import->add_flag("--json", raw_json, "print the node's JSON answer");
  sg::cli::ImageBuildOptions build_opts;
  CLI::App* image_build = image_cmd->add_subcommand(
      "build", "Build an image on the node: a Debian bookworm base made with mmdebstrap (or --from IMAGE), then "
               "--packages, the --copy steps and the --run steps (in that order), each sealed as a layer");
  image_build->add_option("name", build_opts.name, "the new image's name (A-Z a-z 0-9 . _ : -)")->required();
  image_build->add_option("--from", build_opts.from, "build on this image's layers instead of a Debian base");
  image_build->add_option("--packages", build_opts.packages,
                          "Debian packages to install (comma-separated; mmdebstrap --include, or apt-get with --from)")
      ->delimiter(',');
  std::vector<std::string> build_runs, build_copies;
  CLI::Option* run_opt = image_build->add_option(
      "--run", build_runs, "a shell command run in the image, as its root (repeatable; with --copy, in the order given)");
  CLI::Option* copy_opt = image_build->add_option("--copy", build_copies,
                          "HOSTPATH:DEST: files on the node copied into the image, owned by its root (repeatable)");
  image_build->add_option("--workdir", build_opts.workdir, "the image's working directory (absolute)");
  image_build->add_option("--env", build_opts.env, "K=V in the image's environment (repeatable)");
  image_build->add_option("--variant", build_opts.variant, "mmdebstrap variant of the base: minbase (default: essential packages + apt) or essential (no apt)");
  image_build->add_option("--timeout", build_opts.timeout_secs, "seconds the whole build may take (node default 1800)")
      ->check(CLI::Range(1, 6 * 3600));
  CLI::App* image_ls = image_cmd->add_subcommand("ls", "List images");
  image_ls->add_flag("--json", raw_json, "print the node's JSON answer");
  CLI::App* image_inspect = image_cmd->add_subcommand("inspect", "Show an image's record: layers, config, parent");
  image_inspect->add_option("name", ref, "the image's name")->required();
  CLI::App* image_rm = image_cmd->add_subcommand("rm", "Remove an image (and the layers no other image uses)");
  image_rm->add_option("name", ref, "the image's name")->required();

  CLI::App* version = app.add_subcommand("version", "Print the CLI version");

  // CLI11 reports parse problems by throwing; this is the one place exceptions are caught, and they become
  // exit code 2 (CLI11's own codes, e.g. 106/109, would make "usage error" hard to test for).
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? kExitOk : kExitUsage;  // --help and --version are "errors" with code 0
  }

  if (version->parsed()) {
    std::cout << "sandgate " << sg::cli::kVersion << "\n";
    return kExitOk;
  }

  const sg::cli::Environment env = sg::cli::process_environment();
  auto address = sg::parse_api_address(api);
  if (!address)
    return error(address.message() + " (from --api or SANDGATE_API): set it to the address sandgate-node serves, "
                                     "e.g. export SANDGATE_API=unix:$PWD/.state/node.sock as deploy/quickstart.sh "
                                     "prints",
                 kExitUsage);

  if (ssh_config->parsed() || ssh_proxy->parsed()) {
    // The node's socket directory may say where its ingress is (see cli/settings.h).
    const std::string ingress_file = sg::cli::ingress_file_path(*address);
    auto resolved = sg::cli::resolve_ingress({ingress, cacert, domain}, env, ingress_file);
    if (!resolved) return error(resolved.message(), kExitUsage);
    const sg::cli::IngressSettings& in = resolved->settings;
    if (ssh_config->parsed()) {
      if (resolved->ingress_from.empty())
        std::cerr << "sandgate: note: no --ingress, no SANDGATE_INGRESS"
                  << (ingress_file.empty() ? "" : " and no " + ingress_file) << ", so the block uses the default "
                  << in.ingress << "; if sandgate-proxy listens elsewhere, pass --ingress HOST:PORT\n";
      sg::cli::SshConfigOptions o{ref, ssh_user, in.ingress, in.domain, in.cacert, self_path()};
      auto block = sg::cli::ssh_config_block(o);
      if (!block) return error(block.message(), kExitUsage);
      std::cout << *block;
      std::cout.flush();
      return std::cout ? kExitOk : error("cannot write to stdout");
    }
    auto host = sg::cli::parse_ssh_host(ref, in.domain);
    if (!host) return error(host.message(), kExitUsage);
    auto where = sg::parse_ingress(in.ingress);
    if (!where) return error(where.message(), kExitUsage);
    token = sg::cli::setting(token, env, "SANDGATE_TOKEN", "");
    if (token.empty()) {
      auto home = sg::cli::default_config_home();
      auto saved = home ? sg::cli::load_token(*home, host->name) : sg::Result<std::string>(home.failure());
      if (!saved)
        return error("no token for sandbox " + host->name + ": " + saved.message() +
                         " (`sandgate create` saves it there, for the user who created the sandbox). Pass it with "
                         "--token or SANDGATE_TOKEN",
                     kExitUsage);
      token = std::move(*saved);
    }
    sg::cli::SshProxyOptions o;
    o.ingress = *where;
    o.ingress_from = resolved->ingress_from;
    o.cacert = in.cacert;
    o.token = token;
    o.name = host->name;
    o.domain = host->domain;
    o.port = ssh_port;
    // A tunnel peer that goes away must be an error to report, not a silent kill on the next write.
    std::signal(SIGPIPE, SIG_IGN);
    return sg::cli::run_ssh_proxy(o, STDIN_FILENO, STDOUT_FILENO);
  }

  sg::IngressAccess access;
  // The ingress and the node's TCP listener (node.api_listen) both need the operator token; only the unix
  // socket trusts whoever can open it.
  if (address->kind == sg::ApiAddress::Kind::kHttps || address->endpoint.kind == sg::Endpoint::Kind::kTcp)
    access.token = sg::cli::setting(token, env, "SANDGATE_TOKEN", "");
  if (address->kind == sg::ApiAddress::Kind::kHttps) {
    access.cacert = sg::cli::setting(cacert, env, "SANDGATE_CACERT", "");
    if (std::string dial = sg::cli::setting(connect_to, env, "SANDGATE_INGRESS", ""); !dial.empty()) {
      auto where = sg::parse_ingress(dial);
      if (!where) return error(where.message() + " (from --connect-to or SANDGATE_INGRESS)", kExitUsage);
      access.connect_to = *where;
    }
  }
  const bool sent_token = !access.token.empty();
  const Node node{ApiClient(*address, kRequestTimeoutMs, std::move(access)), sg::api_address_string(*address),
                  sent_token};
  auto now = std::chrono::system_clock::now();

  if (create->parsed()) {
    if (name_opt->count() > 0) create_opts.name = name;
    if (timeout_opt->count() > 0) create_opts.timeout_secs = timeout_secs;
    if (hibernate_opt->count() > 0) create_opts.hibernate_after_secs = hibernate_after_secs;
    if (driver_opt->count() > 0) create_opts.driver = driver;
    if (image_opt->count() > 0) create_opts.image = image;
    if (pids_opt->count() > 0) create_opts.pids_max = pids_max;
    if (disk_opt->count() > 0) create_opts.disk_mb = disk_mb;
    if (internet_opt->count() > 0) create_opts.internet = true;
    if (no_internet_opt->count() > 0) create_opts.internet = false;
    if (cpus_opt->count() > 0) create_opts.cpus = cpus;
    if (memory_opt->count() > 0) create_opts.memory_mb = memory_mb;
    if (cwd_opt->count() > 0) create_opts.cwd = cwd;
    if (from_opt->count() > 0) create_opts.from = from;
    auto body = sg::cli::create_request_body(create_opts);
    if (!body) return error(body.message(), kExitUsage);
    return create_sandbox(node, *body, name, raw_json);
  }
  if (ls->parsed())
    return call(node, "ls", "GET", "/v1/sandboxes", "", raw_json,
                [&](const json& j) { return sg::cli::format_list(j, now); });
  if (nodes->parsed())
    return call(node, "nodes", "GET", "/v1/fleet/nodes", "", raw_json,
                [&](const json& j) { return sg::cli::format_nodes(j); });
  if (node_drain->parsed() || node_undrain->parsed()) {
    bool drain = node_drain->parsed();
    if (auto valid = sg::cli::check_node_name(ref); !valid) return error(valid.message(), kExitUsage);
    return call(node, drain ? "node drain" : "node undrain", drain ? "POST" : "DELETE",
                "/v1/fleet/nodes/" + ref + "/drain", "", raw_json, [&](const json& j) {
                  return drain ? sg::cli::format_drained(j) : "node " + ref + " is ready\n";
                });
  }
  if (get->parsed())
    return call(node, "get", "GET", sg::cli::sandbox_path(ref), ref, raw_json,
                [&](const json& j) { return sg::cli::format_sandbox(j, now); });
  if (suspend->parsed()) return change_state(node, "suspend", "suspended", ref);
  if (resume->parsed()) return change_state(node, "resume", "resumed", ref);
  if (rm->parsed()) return remove_sandbox(node, ref);
  if (rotate->parsed()) return rotate_token(node, ref, raw_json);
  if (checkpoint->parsed()) {
    auto body = sg::cli::checkpoint_body(checkpoint_type);
    if (!body) return error(body.message(), kExitUsage);
    std::string raw;
    auto answer = node.send("checkpoint", "POST", sg::cli::sandbox_path(ref, "checkpoint"), *body, ref, &raw);
    if (!answer) return error(answer.message());
    return print(*answer, raw, raw_json, sg::cli::format_checkpoint);
  }
  if (fork_cmd->parsed()) return fork_sandbox(node, ref, fork_count, fork_prefix, raw_json);
  if (expose->parsed() || unexpose->parsed()) {
    auto call = sg::cli::expose_call(ref, port_flag, expose_public);
    if (!call) return error(call.message(), kExitUsage);
    if (unexpose->parsed() && port_flag.find('/') != std::string::npos)
      return error("unexpose takes a PORT, not PORT/PROTO", kExitUsage);
    std::string raw;
    auto answer = expose->parsed() ? node.send("expose", "PUT", call->path, call->body, ref, &raw)
                                   : node.send("unexpose", "DELETE", call->path, nullptr, ref, &raw);
    if (!answer) return error(answer.message());
    if (unexpose->parsed())
      return print(*answer, raw, raw_json, [&](const json&) { return "port " + port_flag + " of " + ref + " closed\n"; });
    const int port = std::stoi(port_flag);  // parse_port_flag checked it
    return print(*answer, raw, raw_json, [port](const json& j) { return sg::cli::format_exposed(j, port); });
  }
  if (ssh_keys_add->parsed()) {
    auto text = sg::cli::read_small_file(key_file, sg::kMaxPublicKeyLine);
    if (!text) return error("ssh-keys add: " + text.message());
    std::string raw;
    auto answer = node.send("ssh-keys add", "POST", "/v1/ssh-keys", sg::cli::ssh_key_add_body(*text, key_label), "",
                            &raw);
    if (!answer) return error(answer.message());
    return print(*answer, raw, raw_json, sg::cli::format_ssh_key_added);
  }
  if (ssh_keys_ls->parsed())
    return call(node, "ssh-keys ls", "GET", "/v1/ssh-keys", "", raw_json, sg::cli::format_ssh_key_list);
  if (ssh_keys_rm->parsed())
    return call(node, "ssh-keys rm", "DELETE", sg::cli::ssh_key_path(key_label), "", false,
                [&](const json&) { return "removed " + key_label + "\n"; });
  if (snapshots->parsed())
    return call(node, "snapshots", "GET", "/v1/snapshots", "", raw_json,
                [&](const json& j) { return sg::cli::format_snapshot_list(j, now); });
  if (snapshot_rm->parsed())
    return call(node, "snapshot rm", "DELETE", sg::cli::snapshot_path(ref), ref, false,
                [&](const json& j) {
                  // Its disk stays (unlisted) while a later checkpoint's disk holds only the changes over it.
                  return "removed snapshot " + ref + (j.contains("removed") ? " (its disk stays until the snapshots "
                                                                              "whose disks read it are removed)"
                                                                            : "") + "\n";
                });
  if (image_import->parsed()) {
    std::error_code ec;
    std::string cwd = std::filesystem::current_path(ec).string();
    auto body = sg::cli::image_import_body(archive_file, ref, cwd);
    if (!body) return error(body.message(), kExitUsage);
    std::string raw;
    auto answer = node.send("image import", "POST", "/v1/images", *body, ref, &raw);
    if (!answer) return error(answer.message());
    return print(*answer, raw, raw_json, sg::cli::format_image_imported);
  }
  if (image_build->parsed()) {
    // CLI11 collects each option's values apart; its parse order (one entry per occurrence) restores the
    // interleaving of --copy and --run, which a build must keep (a --run may need what a --copy brought).
    size_t next_run = 0, next_copy = 0;
    for (const CLI::Option* o : image_build->parse_order()) {
      if (o == run_opt && next_run < build_runs.size())
        build_opts.steps.push_back({sg::cli::ImageBuildStep::Kind::kRun, build_runs[next_run++]});
      else if (o == copy_opt && next_copy < build_copies.size())
        build_opts.steps.push_back({sg::cli::ImageBuildStep::Kind::kCopy, build_copies[next_copy++]});
    }
    return build_image(node, build_opts);
  }
  if (image_ls->parsed())
    return call(node, "image ls", "GET", "/v1/images", "", raw_json,
                [&](const json& j) { return sg::cli::format_image_list(j, now); });
  if (image_inspect->parsed())
    return call(node, "image inspect", "GET", sg::cli::image_path(ref), ref, false,
                [](const json& j) { return j.dump(2) + "\n"; });
  if (image_rm->parsed())
    return call(node, "image rm", "DELETE", sg::cli::image_path(ref), ref, false,
                [&](const json&) { return "removed image " + ref + "\n"; });
  return error("no command given; see sandgate --help", kExitUsage);  // unreachable: require_subcommand(1)
}
