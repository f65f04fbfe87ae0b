// `sandgate`: the command line client of sandgate-node (docs/node-api.md).
// Exit codes: 0 success, 1 the node refused or could not be reached (its message on stderr), 2 usage error.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>

#include "cli/api_client.h"
#include "cli/commands.h"

namespace {

using nlohmann::json;
using sg::cli::ApiClient;

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

// Sends one request and prints the answer: raw JSON with --json, else through `format`.
template <typename Format>
int call(const ApiClient& client, std::string_view method, const std::string& path, const json& body,
         bool raw_json, Format format) {
  auto res = client.request(method, path, body);
  if (!res) return error(res.message());
  if (res->status < 200 || res->status > 299) return error(sg::cli::error_message(res->status, res->body));
  auto parsed = sg::cli::parse_object(res->body);
  if (!parsed) return error(parsed.message());
  if (raw_json) {
    std::cout << res->body;
    if (res->body.empty() || res->body.back() != '\n') std::cout << "\n";
  } else {
    std::cout << format(*parsed);
  }
  std::cout.flush();
  return std::cout ? kExitOk : error("cannot write to stdout");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Create and manage sandboxes on a sandgate-node.", "sandgate"};
  app.require_subcommand(1);
  // Subcommands inherit this, so global options such as --api also work after the subcommand name.
  app.fallthrough();
  app.set_version_flag("--version", "sandgate " + std::string(sg::cli::kVersion));

  std::string api(sg::cli::kDefaultApi);
  app.add_option("--api", api, "node API address: unix:/path or http://127.0.0.1:PORT")
      ->envname("SANDGATE_API")
      ->capture_default_str();

  bool raw_json = false;
  std::string ref;

  sg::cli::CreateOptions create_opts;
  std::string name, cwd;
  uint32_t timeout_secs = 0, memory_mb = 0, hibernate_after_secs = 0;
  std::string driver;
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
  // One port per --expose: a greedy vector option would swallow the command when `--` is forgotten.
  create->add_option("--expose", create_opts.expose, "port reachable at https://PORT-NAME.DOMAIN (repeatable)")
      ->allow_extra_args(false);
  auto* cpus_opt = create->add_option("--cpus", cpus, "CPU limit, in CPUs (e.g. 0.5)");
  auto* memory_opt = create->add_option("--memory-mb", memory_mb, "memory limit in MiB");
  create->add_option("--env", create_opts.env, "environment variable KEY=VALUE (repeatable)")
      ->allow_extra_args(false);
  auto* cwd_opt = create->add_option("--cwd", cwd, "working directory of CMD");
  create->add_flag("--json", raw_json, "print the node's JSON answer");
  create->add_option("command", create_opts.command, "the command and its arguments, after --")->required();

  CLI::App* ls = app.add_subcommand("ls", "List sandboxes");
  ls->add_flag("--json", raw_json, "print the node's JSON answer");

  CLI::App* get = app.add_subcommand("get", "Show one sandbox");
  get->add_option("sandbox", ref, "name or id")->required();
  get->add_flag("--json", raw_json, "print the node's JSON answer");

  CLI::App* suspend = app.add_subcommand("suspend", "Suspend a sandbox now (it wakes on the next request)");
  suspend->add_option("sandbox", ref, "name or id")->required();
  CLI::App* resume = app.add_subcommand("resume", "Resume a suspended sandbox");
  resume->add_option("sandbox", ref, "name or id")->required();
  CLI::App* rm = app.add_subcommand("rm", "Terminate and remove a sandbox");
  rm->add_option("sandbox", ref, "name or id")->required();

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

  auto endpoint = sg::cli::parse_api_address(api);
  if (!endpoint) return error(endpoint.message() + " (from --api or SANDGATE_API)", kExitUsage);
  ApiClient client(*endpoint, kRequestTimeoutMs);
  auto now = std::chrono::system_clock::now();

  if (create->parsed()) {
    if (name_opt->count() > 0) create_opts.name = name;
    if (timeout_opt->count() > 0) create_opts.timeout_secs = timeout_secs;
    if (hibernate_opt->count() > 0) create_opts.hibernate_after_secs = hibernate_after_secs;
    if (driver_opt->count() > 0) create_opts.driver = driver;
    if (cpus_opt->count() > 0) create_opts.cpus = cpus;
    if (memory_opt->count() > 0) create_opts.memory_mb = memory_mb;
    if (cwd_opt->count() > 0) create_opts.cwd = cwd;
    auto body = sg::cli::create_request_body(create_opts);
    if (!body) return error(body.message(), kExitUsage);
    return call(client, "POST", "/v1/sandboxes", *body, raw_json, sg::cli::format_created);
  }
  if (ls->parsed())
    return call(client, "GET", "/v1/sandboxes", nullptr, raw_json,
                [&](const json& j) { return sg::cli::format_list(j, now); });
  if (get->parsed())
    return call(client, "GET", sg::cli::sandbox_path(ref), nullptr, raw_json,
                [&](const json& j) { return sg::cli::format_sandbox(j, now); });
  if (suspend->parsed())
    return call(client, "POST", sg::cli::sandbox_path(ref, "suspend"), nullptr, false,
                sg::cli::format_state_change);
  if (resume->parsed())
    return call(client, "POST", sg::cli::sandbox_path(ref, "resume"), nullptr, false,
                sg::cli::format_state_change);
  if (rm->parsed())
    return call(client, "DELETE", sg::cli::sandbox_path(ref), nullptr, false, sg::cli::format_state_change);
  return error("no command given; see sandgate --help", kExitUsage);  // unreachable: require_subcommand(1)
}
