// The pure parts of the `sandgate` CLI: command line values -> request bodies and paths, node answers -> text.
// Kept free of I/O and of CLI11 so they can be unit tested (tests/unit/cli).
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"

namespace sg::cli {

inline constexpr std::string_view kVersion = "0.1.0";
// Every driver sandgate knows; which of them a node has enabled is the node's answer to give.
inline constexpr std::string_view kDrivers[] = {"process", "qemu", "firecracker", "cloud-hypervisor"};

using TimePoint = std::chrono::system_clock::time_point;

// `sandgate create` flags as typed; unset optionals are left out of the body so the node applies its defaults.
struct CreateOptions {
  std::optional<std::string> name;
  bool ephemeral = false;
  std::optional<uint32_t> timeout_secs;
  std::optional<uint32_t> hibernate_after_secs;
  std::optional<std::string> driver;
  std::optional<std::string> image;  // the root filesystem's image; default: the node's default_image
  std::vector<std::string> expose;   // --expose PORT[/PROTO]: behind the sandbox token
  std::vector<std::string> publish;  // --public PORT[/PROTO]: no token needed
  std::optional<double> cpus;
  std::optional<uint32_t> memory_mb;
  std::optional<uint32_t> pids_max;
  std::optional<uint32_t> disk_mb;
  std::optional<bool> internet;        // --internet / --no-internet; default: the node's
  std::vector<std::string> allow_out;  // --allow-out CIDR[:PORT]
  std::vector<std::string> deny_out;   // --deny-out CIDR[:PORT]
  std::vector<std::string> env;  // "K=V" as given
  std::optional<std::string> cwd;
  std::optional<std::string> from;  // --from SNAP: the snapshot's root filesystem and defaults
  std::vector<std::string> command;
};

// One --expose/--public value: "PORT" or "PORT/PROTO" with PROTO one of http1 (the default), h2c, tcp.
struct PortFlag {
  int port = 0;
  std::string protocol = "http1";
};
// kInvalidArgument naming `flag` and the value.
Result<PortFlag> parse_port_flag(std::string_view flag, std::string_view value);

// The POST /v1/sandboxes body. kInvalidArgument (a usage error) for what the CLI can tell is wrong by itself:
// no command (unless --from: the snapshot's is the default), a malformed or repeated port, an --env without '=', a --driver outside kDrivers. Everything
// else is left to the node. Private http1 ports go in "exposed_ports", every other port in "ports".
Result<nlohmann::json> create_request_body(const CreateOptions& opts);

// "/v1/sandboxes/<ref>[/<action>]" with ref percent-encoded (it is user input placed in a path).
std::string sandbox_path(std::string_view ref, std::string_view action = {});

// "/v1/images/<name>", percent-encoded like sandbox_path.
std::string image_path(std::string_view name);
// The POST /v1/images body; a relative `archive` is made absolute against `cwd` (the node reads the file
// from its own disk and working directory). kInvalidArgument for an empty path or name.
Result<nlohmann::json> image_import_body(std::string_view archive, std::string_view name, std::string_view cwd);
// `sandgate image build` (docs/images.md).
struct ImageBuildStep {
  enum class Kind { kCopy, kRun } kind = Kind::kRun;
  std::string text;  // kRun: the shell command; kCopy: "HOSTPATH:DEST" (split at the last ':')
};
struct ImageBuildOptions {
  std::string name, from, variant, workdir;
  std::vector<std::string> packages, env;
  std::vector<ImageBuildStep> steps;  // --copy and --run in the order given
  uint32_t timeout_secs = 0;          // 0: the node's default
};
// The POST /v1/images/build body. Copy sources are made absolute against `cwd`: the node reads them itself
// (the endpoint is on the node's unix socket only). kInvalidArgument for a copy without ":DEST".
Result<nlohmann::json> image_build_body(const ImageBuildOptions& opts, std::string_view cwd);
// One progress line of a build for the terminal: "step 2/4: run: make\n", "  | OUTPUT\n"; "" for events that
// print nothing (a layer, the final image or error, which the caller words).
std::string format_build_event(const nlohmann::json& event);
// `sandgate image build`: "built image NAME: N layers, SIZE".
std::string format_image_built(const nlohmann::json& image);
// 1536 -> "1.5 KiB"; below 1 KiB whole bytes.
std::string format_bytes(uint64_t bytes);
// `sandgate image import`: "imported image NAME: N layers, SIZE (FORMAT)".
std::string format_image_imported(const nlohmann::json& image);
// `sandgate image ls`: the {"images": [...]} answer as a table NAME LAYERS SIZE FORMAT AGE.
std::string format_image_list(const nlohmann::json& answer, TimePoint now);

// Snapshots (docs/snapshots.md). "/v1/snapshots/<id>", percent-encoded like sandbox_path.
std::string snapshot_path(std::string_view id);

// `ssh-keys` (docs/ssh.md): DELETE's path, POST's body ({"public_key": the .pub file's text, "label" when
// given}), and what add and ls print.
std::string ssh_key_path(std::string_view label);
nlohmann::json ssh_key_add_body(std::string_view public_key, std::string_view label);
std::string format_ssh_key_added(const nlohmann::json& key);
std::string format_ssh_key_list(const nlohmann::json& answer);
// The POST /v1/sandboxes/<ref>/checkpoint body; kInvalidArgument for a --type other than filesystem, memory.
Result<nlohmann::json> checkpoint_body(std::string_view type);
// `sandgate checkpoint`: the snapshot id, alone on its line (scripts read it).
// `sandgate fork`: "snapshot snap-...", then one line per fork as create prints it.
std::string format_fork(const nlohmann::json& answer);
std::string format_checkpoint(const nlohmann::json& answer);
// `sandgate expose NAME PORT[/PROTO] [--public]`: the PUT /v1/sandboxes/<ref>/ports/<port> path and body;
// kInvalidArgument (a usage error) for a malformed PORT[/PROTO].
struct ExposeCall {
  std::string path;
  nlohmann::json body;
};
Result<ExposeCall> expose_call(std::string_view ref, std::string_view port_flag, bool is_public);
// Its answer (the sandbox): the port's URL, alone on its line, and "(public: no token needed)" when it is.
std::string format_exposed(const nlohmann::json& sandbox, int port);
// `sandgate snapshots`: the {"snapshots": [...]} answer as a table ID SOURCE TYPE LAYERS LAYER-SIZE AGE.
std::string format_snapshot_list(const nlohmann::json& answer, TimePoint now);

// A 2xx answer's body, which must be a JSON object; `where` (the API address) is named when it is not one.
Result<nlohmann::json> parse_object(std::string_view body, std::string_view where);

// What the CLI asked when the node said no: enough to name the next step.
struct ErrorContext {
  std::string_view command;  // "create", "ls", "get", "suspend", "resume", "rm", "image import", ...
  std::string_view ref;      // the sandbox (or image) the command names (create: --name), "" if none
  std::string_view where;    // the API address, as api_address_string() writes it
  bool sent_token = false;   // an operator token went with the request (https API)
};
// What to tell the user for a non-2xx answer: the cause (the node's "message", else the status line and the
// body's start) and what to do next. A 401 is the ingress's: which token to pass. An answer that is not
// sandgate-node's JSON: check the API address.
std::string error_message(int status, std::string_view body, const ErrorContext& ctx);

// How a sandbox is named in messages and in the token file: its name, else its id ("-" if neither).
std::string sandbox_label(const nlohmann::json& sandbox);
// For a sandbox JSON in state "failed": why, and what to do (remove it, create it again); `attempted` is what
// could not be done, e.g. "resumed", or "" after create (it failed as it started). nullopt for other states.
std::optional<std::string> failed_message(const nlohmann::json& sandbox, std::string_view attempted);

// "2026-11-29T10:00:00.000Z" (the node's format; fraction optional). nullopt if malformed.
std::optional<TimePoint> parse_timestamp(std::string_view text);
// "42s", "5m", "3h", "2d": the largest whole unit, like `ps`/`kubectl` ages.
std::string format_duration(std::chrono::seconds d);
// `s` without leading and trailing whitespace.
std::string_view trim(std::string_view s);
// Arguments joined by spaces, each quoted for a POSIX shell only if it needs it.
std::string shell_join(const std::vector<std::string>& args);

// `sandgate create`: id, name, state (and why, if it failed), one url line per exposed port, and the token
// when the answer has one.
std::string format_created(const nlohmann::json& sandbox);
// `sandgate ls`: the {"sandboxes": [...]} answer as a table ID NAME DRIVER STATE TIER PORTS IDLE-IN NEXT AGE,
// where TIER is memory/disk for a suspended sandbox and NEXT the idle policy's next step ("hibernate in 5m").
// With a NODE column after NAME when the node is in a fleet (its sandboxes carry "node").
std::string format_list(const nlohmann::json& answer, TimePoint now);
// `sandgate nodes`: NAME STATE SANDBOXES CAPACITY API, the answering node marked with "*".
std::string format_nodes(const nlohmann::json& answer);
// `sandgate node drain`: that the node drains, then the sandboxes that stay on it (NAME STATE), which
// keep answering and waking there; none is moved.
std::string format_drained(const nlohmann::json& answer);
// A fleet node name as the config takes it ([a-z0-9-], 1-63 characters), checked before it goes in a path.
Status check_node_name(std::string_view name);
// `sandgate get`: one "key: value" line per field, timestamps with a relative hint.
std::string format_sandbox(const nlohmann::json& sandbox, TimePoint now);
// `sandgate suspend/resume/rm`: "<name or id>: <state>".
std::string format_state_change(const nlohmann::json& sandbox);

}  // namespace sg::cli
