#include "cli/commands.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <set>
#include <utility>

#include "common/api_client.h"
#include "common/egress_rule.h"
#include "common/http.h"

namespace sg::cli {
namespace {

using nlohmann::json;
using Lines = std::vector<std::pair<std::string, std::string>>;

// Node answers are read defensively: a missing or mistyped field renders as "-" instead of throwing.
const json* field(const json& obj, const std::string& key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  return it == obj.end() ? nullptr : &*it;
}

std::string dump(const json& v) { return v.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string scalar(const json* v) {
  if (v == nullptr || v->is_null()) return "-";
  if (v->is_string()) {
    const auto& s = v->get_ref<const std::string&>();
    return s.empty() ? "-" : s;
  }
  return dump(*v);
}

std::string text(const json& obj, const std::string& key) { return scalar(field(obj, key)); }

// Columns padded to their widest cell, two spaces apart, the last one unpadded.
std::string format_table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width(rows[0].size(), 0);
  for (const auto& row : rows)
    for (size_t i = 0; i < row.size(); ++i) width[i] = std::max(width[i], row[i].size());
  std::string out;
  for (const auto& row : rows) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) {
      line += row[i];
      if (i + 1 < row.size()) line += std::string(width[i] - row[i].size() + 2, ' ');
    }
    out += line + "\n";
  }
  return out;
}

std::vector<std::string> strings(const json* v) {
  std::vector<std::string> out;
  if (v == nullptr || !v->is_array()) return out;
  for (const json& item : *v) out.push_back(item.is_string() ? item.get_ref<const std::string&>() : dump(item));
  return out;
}

std::string ports(const json& sandbox, std::string_view sep) {
  std::string out;
  for (const std::string& p : strings(field(sandbox, "exposed_ports"))) out += (out.empty() ? "" : std::string(sep)) + p;
  return out.empty() ? "-" : out;
}

// "8080/http1, 22/tcp public": each port's protocol, and "public" for those that need no token.
std::string port_policies(const json* v) {
  std::string out;
  if (v == nullptr || !v->is_array()) return scalar(v);
  for (const json& p : *v) {
    std::string one = scalar(field(p, "port")) + "/" + scalar(field(p, "protocol"));
    if (const json* pub = field(p, "public"); pub != nullptr && pub->is_boolean() && pub->get<bool>()) one += " public";
    out += (out.empty() ? "" : ", ") + one;
  }
  return out.empty() ? "-" : out;
}

// The urls object's keys are port numbers as strings; JSON objects sort them as text ("10000" < "8080").
std::vector<std::string> urls(const json& sandbox) {
  std::vector<std::pair<long, std::string>> sorted;
  const json* u = field(sandbox, "urls");
  if (u == nullptr || !u->is_object()) return {};
  for (auto it = u->begin(); it != u->end(); ++it) {
    long port = 0;
    std::from_chars(it.key().data(), it.key().data() + it.key().size(), port);
    sorted.emplace_back(port, scalar(&it.value()));
  }
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::string> out;
  for (auto& [port, url] : sorted) out.push_back(std::move(url));
  return out;
}

std::optional<std::chrono::seconds> seconds_between(TimePoint from, const json* to_text) {
  if (to_text == nullptr || !to_text->is_string()) return std::nullopt;
  auto to = parse_timestamp(to_text->get_ref<const std::string&>());
  if (!to) return std::nullopt;
  return std::chrono::duration_cast<std::chrono::seconds>(*to - from);
}

std::string relative(TimePoint now, const json* when) {
  auto d = seconds_between(now, when);
  if (!d) return scalar(when);
  std::string hint = d->count() > 0 ? "in " + format_duration(*d) : format_duration(-*d) + " ago";
  return when->get_ref<const std::string&>() + " (" + hint + ")";
}

std::string key_values(const Lines& lines) {
  size_t width = 0;
  for (const auto& [key, value] : lines) width = std::max(width, key.size());
  std::string out;
  for (const auto& [key, value] : lines) out += key + ":" + std::string(width - key.size() + 1, ' ') + value + "\n";
  return out;
}

bool parse_int(std::string_view s, int* out) {
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && ptr == s.data() + s.size();
}

}  // namespace

Result<PortFlag> parse_port_flag(std::string_view flag, std::string_view value) {
  auto bad = [&](std::string_view why) {
    return fail(Error::kInvalidArgument,
                std::string(flag) + " " + std::string(value) + ": " + std::string(why) + " (expected PORT[/PROTO])");
  };
  PortFlag out;
  std::string_view number = value.substr(0, value.find('/'));
  if (number.size() < value.size()) {
    std::string_view protocol = value.substr(number.size() + 1);
    if (protocol != "http1" && protocol != "h2c" && protocol != "tcp")
      return bad("the protocol must be http1, h2c or tcp");
    out.protocol = std::string(protocol);
  }
  if (!parse_int(number, &out.port) || out.port < 1 || out.port > 65535) return bad("a port must be 1-65535");
  return out;
}

Result<json> create_request_body(const CreateOptions& opts) {
  if (opts.command.empty() && !opts.from)
    return fail(Error::kInvalidArgument, "a command is required: sandgate create [OPTIONS] -- CMD [ARGS...]");
  json body = json::object();
  if (opts.name) body["name"] = *opts.name;
  if (!opts.command.empty()) body["command"] = opts.command;
  if (opts.from) body["snapshot_id"] = *opts.from;
  if (!opts.env.empty()) {
    json env = json::object();
    for (const std::string& kv : opts.env) {
      auto eq = kv.find('=');
      if (eq == std::string::npos || eq == 0)
        return fail(Error::kInvalidArgument, "--env expects KEY=VALUE, got '" + kv + "'");
      env[kv.substr(0, eq)] = kv.substr(eq + 1);  // a repeated key: the last one wins, as in a shell
    }
    body["env"] = std::move(env);
  }
  if (opts.cwd) body["cwd"] = *opts.cwd;
  json exposed = json::array();
  json ports = json::array();
  std::set<int> seen;
  for (bool is_public : {false, true}) {
    const char* flag = is_public ? "--public" : "--expose";
    for (const std::string& value : is_public ? opts.publish : opts.expose) {
      auto port = parse_port_flag(flag, value);
      if (!port) return port.failure();
      if (!seen.insert(port->port).second)
        return fail(Error::kInvalidArgument,
                    std::string(flag) + " " + value + ": port " + std::to_string(port->port) + " is given twice");
      if (!is_public && port->protocol == "http1") {
        exposed.push_back(port->port);
      } else {
        ports.push_back({{"port", port->port}, {"public", is_public}, {"protocol", port->protocol}});
      }
    }
  }
  if (!exposed.empty()) body["exposed_ports"] = std::move(exposed);
  if (!ports.empty()) body["ports"] = std::move(ports);
  if (opts.timeout_secs) body["timeout_secs"] = *opts.timeout_secs;
  if (opts.hibernate_after_secs) body["hibernate_after_secs"] = *opts.hibernate_after_secs;
  if (opts.driver) {
    if (std::find(std::begin(kDrivers), std::end(kDrivers), *opts.driver) == std::end(kDrivers))
      return fail(Error::kInvalidArgument,
                  "--driver " + *opts.driver + ": must be one of process, qemu, firecracker, cloud-hypervisor");
    body["driver"] = *opts.driver;
  }
  if (opts.image) body["image"] = *opts.image;
  if (opts.pids_max) body["pids_max"] = *opts.pids_max;
  if (opts.disk_mb) body["disk_mb"] = *opts.disk_mb;
  if (opts.internet) body["allow_internet_access"] = *opts.internet;
  for (auto [flag, list, key] : {std::tuple{"--allow-out", &opts.allow_out, "allow_out"},
                                 std::tuple{"--deny-out", &opts.deny_out, "deny_out"}}) {
    for (const std::string& entry : *list) {
      if (auto rule = parse_egress_rule(entry); !rule)
        return fail(Error::kInvalidArgument, std::string(flag) + " " + entry + ": " + rule.message());
    }
    if (!list->empty()) body[key] = *list;
  }
  if (opts.cpus) body["cpus"] = *opts.cpus;
  if (opts.memory_mb) body["memory_mb"] = *opts.memory_mb;
  if (opts.ephemeral) body["ephemeral"] = true;
  return body;
}

namespace {
// `prefix` + `ref` percent-encoded (it is user input placed in a path).
std::string resource_path(std::string path, std::string_view ref) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  for (unsigned char c : ref) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      path += static_cast<char>(c);
    } else {
      path += '%';
      path += kHex[c >> 4];
      path += kHex[c & 15];
    }
  }
  return path;
}
}  // namespace

std::string sandbox_path(std::string_view ref, std::string_view action) {
  std::string path = resource_path("/v1/sandboxes/", ref);
  if (!action.empty()) path.append("/").append(action);
  return path;
}

std::string image_path(std::string_view name) { return resource_path("/v1/images/", name); }

Result<json> image_import_body(std::string_view archive, std::string_view name, std::string_view cwd) {
  if (archive.empty()) return fail(Error::kInvalidArgument, "image import: the archive path is empty");
  if (name.empty()) return fail(Error::kInvalidArgument, "image import: the image name is empty");
  // The node reads the file itself, from its own working directory: send it an absolute path.
  std::string path(archive);
  if (path.front() != '/') path = std::string(cwd) + (cwd.ends_with('/') ? "" : "/") + path;
  return json{{"name", name}, {"archive", path}};
}

std::string format_bytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  size_t unit = 0;
  while (v >= 1024 && unit + 1 < std::size(kUnits)) {
    v /= 1024;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, unit == 0 ? "%.0f %s" : "%.1f %s", v, kUnits[unit]);
  return buf;
}

namespace {
uint64_t image_size(const json& image) {
  const json* size = field(image, "size_bytes");
  return size != nullptr && size->is_number_unsigned() ? size->get<uint64_t>() : 0;
}
size_t layer_count(const json& image) {
  const json* layers = field(image, "layers");
  return layers != nullptr && layers->is_array() ? layers->size() : 0;
}
}  // namespace

std::string format_image_imported(const json& image) {
  return "imported image " + text(image, "name") + ": " + std::to_string(layer_count(image)) + " layer" +
         (layer_count(image) == 1 ? "" : "s") + ", " + format_bytes(image_size(image)) + " (" + text(image, "format") +
         ")\n";
}

Result<json> image_build_body(const ImageBuildOptions& o, std::string_view cwd) {
  json body = {{"name", o.name}};
  if (!o.from.empty()) body["from"] = o.from;
  if (!o.variant.empty()) body["variant"] = o.variant;
  if (!o.workdir.empty()) body["workdir"] = o.workdir;
  if (!o.packages.empty()) body["packages"] = o.packages;
  if (!o.env.empty()) body["env"] = o.env;
  if (o.timeout_secs != 0) body["timeout_secs"] = o.timeout_secs;
  if (!o.steps.empty()) {
    json steps = json::array();
    for (const ImageBuildStep& s : o.steps) {
      if (s.kind == ImageBuildStep::Kind::kRun) {
        steps.push_back({{"run", s.text}});
        continue;
      }
      const std::string& c = s.text;
      size_t colon = c.rfind(':');
      if (colon == std::string::npos || colon == 0 || colon + 1 == c.size())
        return fail(Error::kInvalidArgument, "--copy '" + c + "': expected HOSTPATH:DEST (DEST absolute in the image)");
      std::string source = c.substr(0, colon);
      if (source.front() != '/') source = std::string(cwd) + (cwd.ends_with('/') ? "" : "/") + source;
      steps.push_back({{"copy", {{"source", source}, {"dest", c.substr(colon + 1)}}}});
    }
    body["steps"] = std::move(steps);
  }
  return body;
}

std::string format_build_event(const json& event) {
  std::string kind = text(event, "event");
  if (kind == "step") {
    const json* step = field(event, "step");
    const json* steps = field(event, "steps");
    std::string n = step != nullptr && step->is_number_unsigned() ? std::to_string(step->get<uint64_t>()) : "?";
    std::string m = steps != nullptr && steps->is_number_unsigned() ? std::to_string(steps->get<uint64_t>()) : "?";
    return "step " + n + "/" + m + ": " + text(event, "what") + "\n";
  }
  if (kind == "output") return "  | " + text(event, "line") + "\n";
  return "";
}

std::string format_image_built(const json& image) {
  return "built image " + text(image, "name") + ": " + std::to_string(layer_count(image)) + " layer" +
         (layer_count(image) == 1 ? "" : "s") + ", " + format_bytes(image_size(image)) + "\n";
}

std::string format_image_list(const json& answer, TimePoint now) {
  std::vector<std::vector<std::string>> rows = {{"NAME", "LAYERS", "SIZE", "FORMAT", "AGE"}};
  const json* list = field(answer, "images");
  if (list != nullptr && list->is_array()) {
    for (const json& image : *list) {
      auto age = seconds_between(now, field(image, "created_at"));
      rows.push_back({text(image, "name"), std::to_string(layer_count(image)), format_bytes(image_size(image)),
                      text(image, "format"), age ? format_duration(-*age) : "-"});
    }
  }
  return format_table(rows);
}

std::string snapshot_path(std::string_view id) { return resource_path("/v1/snapshots/", id); }

std::string ssh_key_path(std::string_view label) { return resource_path("/v1/ssh-keys/", label); }

json ssh_key_add_body(std::string_view public_key, std::string_view label) {
  json body = {{"public_key", public_key}};
  if (!label.empty()) body["label"] = label;
  return body;
}

std::string format_ssh_key_added(const json& key) {
  return "added " + text(key, "label") + " (" + text(key, "type") + " " + text(key, "fingerprint") + ")\n";
}

std::string format_ssh_key_list(const json& answer) {
  std::vector<std::vector<std::string>> rows = {{"LABEL", "TYPE", "FINGERPRINT"}};
  const json* list = field(answer, "ssh_keys");
  if (list != nullptr && list->is_array())
    for (const json& key : *list) rows.push_back({text(key, "label"), text(key, "type"), text(key, "fingerprint")});
  return format_table(rows);
}

Result<json> checkpoint_body(std::string_view type) {
  if (type != "filesystem" && type != "memory")
    return fail(Error::kInvalidArgument, "--type " + std::string(type) + ": must be filesystem or memory");
  return json{{"type", type}};
}

std::string format_fork(const json& answer) {
  std::string out = "snapshot " + text(answer, "snapshot_id") + "\n";
  auto forks = answer.find("sandboxes");
  if (forks != answer.end() && forks->is_array())
    for (const json& sb : *forks) out += format_created(sb);
  return out;
}

Result<ExposeCall> expose_call(std::string_view ref, std::string_view port_flag, bool is_public) {
  auto flag = parse_port_flag("PORT", port_flag);
  if (!flag) return flag.failure();
  return ExposeCall{sandbox_path(ref, "ports/" + std::to_string(flag->port)),
                    json{{"public", is_public}, {"protocol", flag->protocol}}};
}

std::string format_exposed(const json& sandbox, int port) {
  std::string url = "-", note;
  if (const json* urls = field(sandbox, "urls"); urls != nullptr && urls->is_object())
    url = text(*urls, std::to_string(port));
  if (const json* ports = field(sandbox, "ports"); ports != nullptr && ports->is_array())
    for (const json& p : *ports)
      if (p.is_object() && p.value("port", 0) == port && p.value("public", false)) note = " (public: no token needed)";
  return url + note + "\n";
}

std::string format_checkpoint(const json& answer) { return text(answer, "snapshot_id") + "\n"; }

std::string format_snapshot_list(const json& answer, TimePoint now) {
  std::vector<std::vector<std::string>> rows = {{"ID", "SOURCE", "TYPE", "LAYERS", "LAYER-SIZE", "AGE"}};
  const json* list = field(answer, "snapshots");
  if (list != nullptr && list->is_array()) {
    for (const json& snap : *list) {
      const json* source = field(snap, "source");
      std::string from = "-";
      if (source != nullptr && source->is_object()) {
        const json* name = field(*source, "name");
        from = name != nullptr && name->is_string() ? name->get<std::string>() : text(*source, "id");
      }
      const json* bytes = field(snap, "layer_bytes");
      auto age = seconds_between(now, field(snap, "created_at"));
      rows.push_back({text(snap, "id"), from, text(snap, "type"), std::to_string(layer_count(snap)),
                      format_bytes(bytes != nullptr && bytes->is_number_unsigned() ? bytes->get<uint64_t>() : 0),
                      age ? format_duration(-*age) : "-"});
    }
  }
  return format_table(rows);
}

Result<json> parse_object(std::string_view body, std::string_view where) {
  json j = json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.is_object())
    return fail(Error::kIo, "the server at " + std::string(where) + " answered something that is not a JSON object (" +
                                std::string(body.substr(0, 200)) + "): " + std::string(kCheckApiHint));
  return j;
}

std::string error_message(int status, std::string_view body, const ErrorContext& ctx) {
  static constexpr std::string_view kOperatorToken =
      "pass it with --token or SANDGATE_TOKEN (the file the config's operator_token_file names; "
      "deploy/quickstart.sh keeps it in <state dir>/operator.token)";
  const std::string where(ctx.where);
  // Only the ingress answers 401 (the node API itself has no tokens), and its body names no CLI flag.
  if (status == 401)
    return ctx.sent_token
               ? "the ingress at " + where + " refused the operator token (HTTP 401 Unauthorized): it is not the "
                 "one this ingress expects; " + std::string(kOperatorToken)
               : "the ingress at " + where + " wants the operator token (HTTP 401 Unauthorized) and none was "
                 "given: " + std::string(kOperatorToken);
  json j = json::parse(body, nullptr, false);
  const json* code = field(j, "error");
  const std::string error_code = code != nullptr && code->is_string() ? code->get<std::string>() : "";
  std::string cause;
  const json* m = field(j, "message");
  if (m != nullptr && m->is_string() && !m->get_ref<const std::string&>().empty()) {
    cause = m->get<std::string>();
  } else if (!error_code.empty()) {
    cause = "sandgate-node answered HTTP " + std::to_string(status) + " " + std::string(http_reason(status)) + " (" +
            error_code + ")";
  } else {
    // No error object at all: whatever answered is not sandgate-node's API.
    std::string_view start = body.substr(0, 200);
    while (!start.empty() && std::isspace(static_cast<unsigned char>(start.back()))) start.remove_suffix(1);
    return "the server at " + where + " answered HTTP " + std::to_string(status) + " " +
           std::string(http_reason(status)) + (start.empty() ? "" : ": " + std::string(start)) + "; " +
           std::string(kCheckApiHint);
  }
  const std::string ref(ctx.ref);
  if (ctx.command.starts_with("image")) {
    if (error_code == "already_exists")
      return cause + ": import it under another name, or remove the existing one first with `sandgate image rm " +
             ref + "`";
    if (error_code == "not_found" && ctx.command != "image import")
      return cause + ": `sandgate image ls` lists the images on " + where;
    return cause;
  }
  if (error_code == "already_exists")
    return cause + ": choose another --name, or remove the existing sandbox first with `sandgate rm " + ref + "`";
  // The only thing a create can name that may not exist is its image.
  if (ctx.command == "create" && error_code == "not_found")
    return cause + ": `sandgate image ls` lists the images on " + where;
  if (error_code == "not_found" && !ref.empty())
    return cause + ": `sandgate ls` lists the sandboxes on " + where + " (is that the node you meant?)";
  if (ctx.command == "create" && status >= 500)
    return cause + ". The sandbox was not created: fix the cause (sandgate-node's log has the details), then run "
                   "the same create again";
  return cause;
}

std::string sandbox_label(const json& sandbox) {
  std::string name = text(sandbox, "name");
  return name != "-" ? name : text(sandbox, "id");
}

std::optional<std::string> failed_message(const json& sandbox, std::string_view attempted) {
  if (text(sandbox, "state") != "failed") return std::nullopt;
  const std::string label = sandbox_label(sandbox);
  std::string reason = text(sandbox, "state_reason");
  std::string what = attempted.empty() ? "sandbox " + label + " failed as it started (" + reason + ")"
                                       : "sandbox " + label + " has failed (" + reason +
                                             "), so it cannot be " + std::string(attempted);
  return what + ". A failed sandbox does not run again: remove it with `sandgate rm " + label +
         "` and create it anew (`sandgate get " + label +
         "` shows its command, which must keep running inside the sandbox)";
}

std::optional<TimePoint> parse_timestamp(std::string_view t) {
  // YYYY-MM-DDTHH:MM:SS then an optional .fraction, then Z.
  if (t.size() < 20 || t[4] != '-' || t[7] != '-' || (t[10] != 'T' && t[10] != ' ') || t[13] != ':' ||
      t[16] != ':' || t.back() != 'Z')
    return std::nullopt;
  int y, mo, d, h, mi, s;
  if (!parse_int(t.substr(0, 4), &y) || !parse_int(t.substr(5, 2), &mo) || !parse_int(t.substr(8, 2), &d) ||
      !parse_int(t.substr(11, 2), &h) || !parse_int(t.substr(14, 2), &mi) || !parse_int(t.substr(17, 2), &s))
    return std::nullopt;
  std::chrono::year_month_day ymd{std::chrono::year(y), std::chrono::month(static_cast<unsigned>(mo)),
                                  std::chrono::day(static_cast<unsigned>(d))};
  if (!ymd.ok() || h > 23 || mi > 59 || s > 60) return std::nullopt;
  std::chrono::nanoseconds frac{0};
  std::string_view rest = t.substr(19, t.size() - 20);
  if (!rest.empty()) {
    if (rest[0] != '.' || rest.size() < 2 || rest.size() > 10) return std::nullopt;
    int digits = 0;
    if (!parse_int(rest.substr(1), &digits) || digits < 0) return std::nullopt;
    long long scale = 1;
    for (size_t i = rest.size() - 1; i < 9; ++i) scale *= 10;
    frac = std::chrono::nanoseconds(digits * scale);
  }
  auto tp = std::chrono::sys_days(ymd) + std::chrono::hours(h) + std::chrono::minutes(mi) +
            std::chrono::seconds(s) + frac;
  return std::chrono::time_point_cast<TimePoint::duration>(tp);
}

std::string format_duration(std::chrono::seconds d) {
  long long s = std::max<long long>(d.count(), 0);
  if (s < 60) return std::to_string(s) + "s";
  if (s < 3600) return std::to_string(s / 60) + "m";
  if (s < 86400) return std::to_string(s / 3600) + "h";
  return std::to_string(s / 86400) + "d";
}

std::string_view trim(std::string_view s) {
  constexpr std::string_view kSpace = " \t\r\n\v\f";
  size_t begin = s.find_first_not_of(kSpace);
  if (begin == std::string_view::npos) return {};
  return s.substr(begin, s.find_last_not_of(kSpace) + 1 - begin);
}

std::string shell_join(const std::vector<std::string>& args) {
  std::string out;
  for (const std::string& a : args) {
    if (!out.empty()) out += ' ';
    bool plain = !a.empty() && std::all_of(a.begin(), a.end(), [](unsigned char c) {
      return std::isalnum(c) || std::string_view("-_./:=@%+,").find(static_cast<char>(c)) != std::string_view::npos;
    });
    if (plain) {
      out += a;
      continue;
    }
    out += '\'';
    for (char c : a) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
    out += '\'';
  }
  return out;
}

std::string format_created(const json& sandbox) {
  Lines lines = {{"id", text(sandbox, "id")}, {"name", text(sandbox, "name")}, {"state", text(sandbox, "state")}};
  if (text(sandbox, "state") == "failed") lines.emplace_back("reason", text(sandbox, "state_reason"));
  for (std::string& url : urls(sandbox)) lines.emplace_back("url", std::move(url));
  if (const json* token = field(sandbox, "token"); token != nullptr && token->is_string())
    lines.emplace_back("token", token->get<std::string>());
  return key_values(lines);
}

std::string format_list(const json& answer, TimePoint now) {
  std::vector<std::vector<std::string>> rows = {
      {"ID", "NAME", "DRIVER", "STATE", "TIER", "PORTS", "IDLE-IN", "NEXT", "AGE"}};
  const json* list = field(answer, "sandboxes");
  bool fleet = false;
  if (list != nullptr && list->is_array())
    for (const json& sb : *list) fleet = fleet || (sb.is_object() && sb.contains("node"));
  if (fleet) rows[0].insert(rows[0].begin() + 2, "NODE");
  if (list != nullptr && list->is_array()) {
    for (const json& sb : *list) {
      auto idle = seconds_between(now, field(sb, "idle_deadline_at"));
      auto next = seconds_between(now, field(sb, "next_transition_at"));
      auto age = seconds_between(now, field(sb, "created_at"));
      std::string next_text = "-";
      if (next && text(sb, "next_transition") != "-")
        next_text = text(sb, "next_transition") + " in " + format_duration(*next);
      rows.push_back({text(sb, "id"), text(sb, "name"), text(sb, "driver"), text(sb, "state"), text(sb, "tier"),
                      ports(sb, ","), idle ? std::to_string(std::max<long long>(idle->count(), 0)) : "-", next_text,
                      age ? format_duration(-*age) : "-"});
      if (fleet) rows.back().insert(rows.back().begin() + 2, text(sb, "node"));
    }
  }
  return format_table(rows);
}

std::string format_drained(const json& answer) {
  std::string out = "node " + text(answer, "node") + " is draining: no new sandbox is placed there\n";
  const json* staying = field(answer, "sandboxes");
  if (staying == nullptr || !staying->is_array() || staying->empty()) return out + "no sandbox stays on it\n";
  out += std::to_string(staying->size()) + (staying->size() == 1 ? " sandbox stays" : " sandboxes stay") +
         " on it (they keep answering and waking there; none is moved):\n";
  std::vector<std::vector<std::string>> rows = {{"NAME", "STATE"}};
  for (const json& sb : *staying) rows.push_back({text(sb, "name"), text(sb, "state")});
  return out + format_table(rows);
}

std::string format_nodes(const json& answer) {
  std::vector<std::vector<std::string>> rows = {
      {"NAME", "STATE", "SANDBOXES", "CAPACITY", "MEMORY-MB", "CPUS", "IMAGES", "API"}};
  // "reserved/capacity"; a capacity of 0 (or none published) is no limit.
  auto reserved_of = [](const json& n, const char* reserved, const char* capacity, double unit) {
    auto number = [&](const char* key) {
      const json* v = field(n, key);
      return v != nullptr && v->is_number() ? v->get<double>() / unit : 0.0;
    };
    // MiB as whole numbers (%g would print 1048576 as 1.04858e+06); CPUs with their fraction.
    auto shown = [unit](double v) {
      char text[32];
      std::snprintf(text, sizeof text, unit == 1 ? "%.0f" : "%g", v);
      return std::string(text);
    };
    const double cap = number(capacity);
    return shown(number(reserved)) + "/" + (cap > 0 ? shown(cap) : "-");
  };
  std::string self = text(answer, "node");
  const json* list = field(answer, "nodes");
  if (list != nullptr && list->is_array()) {
    for (const json& n : *list) {
      std::string name = text(n, "name");
      const json* images = field(n, "images");
      rows.push_back({name + (name == self ? " *" : ""), text(n, "state"), text(n, "sandboxes"),
                      text(n, "capacity_sandboxes"),
                      reserved_of(n, "reserved_memory_mb", "capacity_memory_mb", 1),
                      reserved_of(n, "reserved_millicpus", "capacity_millicpus", 1000),
                      images != nullptr && images->is_array() ? std::to_string(images->size()) : "-", text(n, "api")});
    }
  }
  return format_table(rows);
}

Status check_node_name(std::string_view name) {
  bool ok = !name.empty() && name.size() <= 63;
  for (char c : name) ok = ok && ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-');
  if (!ok) return fail(Error::kInvalidArgument, "node name must be 1-63 characters of [a-z0-9-]");
  return {};
}

std::string format_sandbox(const json& sandbox, TimePoint now) {
  static const std::vector<std::string> kOrder = {
      "id",          "name",      "state",   "state_reason", "tier",  "ephemeral",  "driver",
      "command",     "cwd",       "env",     "exposed_ports", "timeout_secs", "hibernate_after_secs", "cpus",
      "memory_mb",   "pid",       "created_at", "last_activity_at", "idle_deadline_at", "next_transition",
      "next_transition_at", "connections", "urls"};
  Lines lines;
  auto add = [&](const std::string& key) {
    const json* v = field(sandbox, key);
    if (key == "command") {
      lines.emplace_back(key, v != nullptr && v->is_array() ? shell_join(strings(v)) : scalar(v));
    } else if (key == "env") {
      std::vector<std::string> kvs;
      if (v != nullptr && v->is_object())
        for (auto it = v->begin(); it != v->end(); ++it) kvs.push_back(it.key() + "=" + scalar(&it.value()));
      lines.emplace_back(key, kvs.empty() ? "-" : shell_join(kvs));
    } else if (key == "exposed_ports") {
      lines.emplace_back(key, ports(sandbox, ", "));
    } else if (key == "ports") {
      lines.emplace_back(key, port_policies(v));
    } else if (key.ends_with("_at")) {
      lines.emplace_back(key, relative(now, v));
    } else if (key == "urls") {
      for (std::string& url : urls(sandbox)) lines.emplace_back("url", std::move(url));
    } else if (v != nullptr && (v->is_array() || v->is_object())) {
      lines.emplace_back(key, dump(*v));
    } else {
      lines.emplace_back(key, scalar(v));
    }
  };
  for (const std::string& key : kOrder) add(key);
  // Fields a newer node added: shown rather than silently dropped.
  const std::set<std::string> known(kOrder.begin(), kOrder.end());
  if (sandbox.is_object())
    for (auto it = sandbox.begin(); it != sandbox.end(); ++it)
      if (!known.count(it.key())) add(it.key());
  return key_values(lines);
}

std::string format_state_change(const json& sandbox) {
  return sandbox_label(sandbox) + ": " + text(sandbox, "state") + "\n";
}

}  // namespace sg::cli
