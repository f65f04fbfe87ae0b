#include "noderuntime/api_request.h"

#include <simdjson.h>

#include <limits>
#include <optional>

namespace sg {
namespace {

using json = nlohmann::json;

// JSON integers arrive as signed or unsigned; huge unsigned values saturate so range checks still see them.
int64_t as_int64(const json& v) {
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    return u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ? std::numeric_limits<int64_t>::max()
                                                                           : static_cast<int64_t>(u);
  }
  return v.get<int64_t>();
}

// {"port": 22, "public": true, "protocol": "tcp"}: only port is required. Ranges, duplicates and the protocol
// name are Node::create's to check, so the messages are the same however a port was given.
Result<CreateRequest::Port> parse_port_entry(const json& entry) {
  if (!entry.is_object()) return wrong_type("ports[]", "an object", entry);
  CreateRequest::Port port;
  bool has_port = false;
  for (auto it = entry.begin(); it != entry.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (key == "port") {
      if (!v.is_number_integer()) return wrong_type("ports[].port", "an integer", v);
      port.port = as_int64(v);
      has_port = true;
    } else if (key == "public") {
      if (!v.is_boolean()) return wrong_type("ports[].public", "true or false", v);
      port.is_public = v.get<bool>();
    } else if (key == "protocol") {
      if (!v.is_string()) return wrong_type("ports[].protocol", "a string (http1, h2c or tcp)", v);
      port.protocol = v.get<std::string>();
    } else {
      return unknown_field("ports[]." + key, "port, public, protocol");
    }
  }
  if (!has_port) return fail(Error::kInvalidArgument, "ports[].port is required");
  return port;
}

Result<std::vector<std::string>> string_list(const json& value, std::string_view field) {
  if (!value.is_array()) return wrong_type(field, "an array of strings", value);
  std::vector<std::string> out;
  for (const json& v : value) {
    if (!v.is_string()) return wrong_type(field, "an array of strings", value);
    out.push_back(v.get<std::string>());
  }
  return out;
}

}  // namespace

Result<json> parse_object(const std::string& body) {
  if (body.empty()) return fail(Error::kInvalidArgument, "request body must be a JSON object, got nothing");
  json j = json::parse(body, nullptr, false);
  if (j.is_discarded()) return fail(Error::kInvalidArgument, "request body is not valid JSON");
  if (!j.is_object())
    return fail(Error::kInvalidArgument, std::string("request body must be a JSON object, got ") + j.type_name());
  return j;
}

Failure wrong_type(std::string_view field, std::string_view expected, const json& got) {
  return fail(Error::kInvalidArgument,
              std::string(field) + ": must be " + std::string(expected) + ", got " + got.type_name());
}

Failure unknown_field(std::string_view field, std::string_view allowed) {
  return fail(Error::kInvalidArgument,
              "unknown field '" + std::string(field) + "' (allowed: " + std::string(allowed) + ")");
}

Result<CreateRequest> parse_create(const json& body) {
  constexpr std::string_view kAllowed =
      "name, command, env, cwd, exposed_ports, ports, allow_unauthenticated_access, timeout_secs, "
      "hibernate_after_secs, cpus, memory_mb, ephemeral, driver, image, pids_max, disk_mb, "
      "allow_internet_access, allow_out, deny_out, snapshot_id";
  CreateRequest req;
  bool has_command = false;
  for (auto it = body.begin(); it != body.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (key == "name") {
      if (v.is_null()) continue;
      if (!v.is_string()) return wrong_type(key, "a string or null", v);
      req.name = v.get<std::string>();
    } else if (key == "command") {
      if (!v.is_array()) return wrong_type(key, "an array of strings", v);
      for (const json& arg : v) {
        if (!arg.is_string()) return wrong_type("command[]", "a string", arg);
        req.command.push_back(arg.get<std::string>());
      }
      has_command = true;
    } else if (key == "env") {
      if (!v.is_object()) return wrong_type(key, "an object of strings", v);
      for (auto e = v.begin(); e != v.end(); ++e) {
        if (!e.value().is_string()) return wrong_type("env." + e.key(), "a string", e.value());
        req.env[e.key()] = e.value().get<std::string>();
      }
    } else if (key == "cwd") {
      if (!v.is_string()) return wrong_type(key, "a string", v);
      req.cwd = v.get<std::string>();
    } else if (key == "exposed_ports") {
      if (!v.is_array()) return wrong_type(key, "an array of integers", v);
      for (const json& port : v) {
        if (!port.is_number_integer()) return wrong_type("exposed_ports[]", "an integer", port);
        req.exposed_ports.push_back(as_int64(port));
      }
    } else if (key == "ports") {
      if (!v.is_array()) return wrong_type(key, "an array of objects", v);
      for (const json& entry : v) {
        auto port = parse_port_entry(entry);
        if (!port) return port.failure();
        req.ports.push_back(std::move(*port));
      }
    } else if (key == "allow_unauthenticated_access") {
      if (!v.is_boolean()) return wrong_type(key, "true or false", v);
      req.allow_unauthenticated_access = v.get<bool>();
    } else if (key == "timeout_secs" || key == "memory_mb" || key == "hibernate_after_secs" || key == "pids_max" ||
               key == "disk_mb") {
      if (!v.is_number_integer()) return wrong_type(key, "an integer", v);
      (key == "timeout_secs"  ? req.timeout_secs
       : key == "memory_mb"   ? req.memory_mb
       : key == "pids_max"    ? req.pids_max
       : key == "disk_mb"     ? req.disk_mb
                              : req.hibernate_after_secs) = as_int64(v);
    } else if (key == "driver") {
      if (!v.is_string()) return wrong_type(key, "a string", v);
      req.driver = v.get<std::string>();
    } else if (key == "image") {
      if (!v.is_string()) return wrong_type(key, "a string", v);
      req.image = v.get<std::string>();
    } else if (key == "snapshot_id") {
      if (!v.is_string()) return wrong_type(key, "a string (snap-...)", v);
      req.snapshot_id = v.get<std::string>();
    } else if (key == "cpus") {
      if (!v.is_number()) return wrong_type(key, "a number", v);
      req.cpus = v.get<double>();
    } else if (key == "ephemeral") {
      if (!v.is_boolean()) return wrong_type(key, "true or false", v);
      req.ephemeral = v.get<bool>();
    } else if (key == "allow_internet_access") {
      if (!v.is_boolean()) return wrong_type(key, "true or false", v);
      req.allow_internet_access = v.get<bool>();
    } else if (key == "allow_out" || key == "deny_out") {
      if (!v.is_array()) return wrong_type(key, "an array of strings", v);
      for (const json& entry : v) {
        if (!entry.is_string()) return wrong_type(key + "[]", "a string", entry);
        (key == "allow_out" ? req.allow_out : req.deny_out).push_back(entry.get<std::string>());
      }
    } else {
      return unknown_field(key, kAllowed);
    }
  }
  // From a snapshot, the snapshot's command is the default.
  if (!has_command && !req.snapshot_id)
    return fail(Error::kInvalidArgument, "command is required (an array of strings: argv)");
  return req;
}

namespace {

std::string_view type_name(simdjson::dom::element_type type) {
  using T = simdjson::dom::element_type;
  switch (type) {
    case T::ARRAY: return "array";
    case T::OBJECT: return "object";
    case T::INT64:
    case T::UINT64:
    case T::DOUBLE: return "number";
    case T::STRING: return "string";
    case T::BOOL: return "boolean";
    case T::NULL_VALUE: return "null";
  }
  return "value";
}

Failure must_be(std::string_view field, std::string_view expected, simdjson::dom::element got) {
  return fail(Error::kInvalidArgument,
              std::string(field) + ": must be " + std::string(expected) + ", got " + std::string(type_name(got.type())));
}

}  // namespace

// The activity report comes from every proxy worker once a second and lists every sandbox with traffic or
// open connections, so its reading is on the node's budget of 1% of a core at 10,000 sandboxes per worker:
// nlohmann's tokenizer took 6.7 ms a report (85 MB/s), Debian's simdjson takes a fraction of that
// (bench/RESULTS.md). The document is walked in order, so the first thing out of place is the one named, in
// the words the other bodies use.
Result<std::vector<ActivityReport>> parse_activity(const std::string& body) {
  if (body.empty()) return fail(Error::kInvalidArgument, "request body must be a JSON object, got nothing");
  // Kept between reports: its buffers grow to the largest report once instead of being made for each.
  thread_local simdjson::dom::parser parser;
  simdjson::dom::element doc;
  if (simdjson::error_code e = parser.parse(body).get(doc); e != simdjson::SUCCESS) {
    // Valid JSON, but no count is that large: simdjson refuses integers beyond 64 bits as it reads them.
    if (e == simdjson::NUMBER_ERROR)
      return fail(Error::kInvalidArgument, "request body has a malformed number or one beyond 64 bits");
    return fail(Error::kInvalidArgument, "request body is not valid JSON");
  }
  simdjson::dom::object top;
  if (doc.get(top) != simdjson::SUCCESS)
    return fail(Error::kInvalidArgument, "request body must be a JSON object, got " + std::string(type_name(doc.type())));
  std::vector<ActivityReport> reports;
  std::vector<bool> own_reporter;  // the entry named its reporter (else the body's applies, wherever it stands)
  std::string default_reporter;
  bool has_list = false;
  for (simdjson::dom::key_value_pair field : top) {
    if (field.key == "reporter") {
      std::string_view reporter;
      if (field.value.get(reporter) != simdjson::SUCCESS) return must_be("reporter", "a string", field.value);
      default_reporter = reporter;
    } else if (field.key == "sandboxes") {
      simdjson::dom::array list;
      if (field.value.get(list) != simdjson::SUCCESS)
        return must_be("sandboxes", "an array of objects", field.value);
      if (has_list) return fail(Error::kInvalidArgument, "sandboxes: given twice");
      has_list = true;
      reports.reserve(list.size());
      own_reporter.reserve(list.size());
      for (simdjson::dom::element item : list) {
        simdjson::dom::object entry;
        if (item.get(entry) != simdjson::SUCCESS) return must_be("sandboxes[]", "an object", item);
        ActivityReport& r = reports.emplace_back();
        own_reporter.push_back(false);
        bool has_id = false;
        for (simdjson::dom::key_value_pair f : entry) {
          if (f.key == "id" || f.key == "reporter") {
            std::string_view text;
            if (f.value.get(text) != simdjson::SUCCESS)
              return must_be("sandboxes[]." + std::string(f.key), "a string", f.value);
            if (f.key == "id") {
              r.id = text;
              has_id = true;
            } else {
              r.reporter = text;
              own_reporter.back() = true;
            }
          } else if (f.key == "bytes_in" || f.key == "bytes_out" || f.key == "connections") {
            uint64_t n = 0;
            if (f.value.get(n) != simdjson::SUCCESS)
              return must_be("sandboxes[]." + std::string(f.key), "a non-negative integer", f.value);
            (f.key == "bytes_in" ? r.bytes_in : f.key == "bytes_out" ? r.bytes_out : r.connections) = n;
          } else {
            return unknown_field("sandboxes[]." + std::string(f.key), "id, bytes_in, bytes_out, connections, reporter");
          }
        }
        if (!has_id) return fail(Error::kInvalidArgument, "sandboxes[].id is required");
      }
    } else {
      return unknown_field(field.key, "sandboxes, reporter");
    }
  }
  if (!has_list) return fail(Error::kInvalidArgument, "sandboxes is required (an array of objects)");
  for (size_t i = 0; i < reports.size(); ++i)
    if (!own_reporter[i]) reports[i].reporter = default_reporter;
  return reports;
}

Result<PortRequest> parse_port_request(const json& body, PortRequestKind kind) {
  const bool open = kind == PortRequestKind::kOpen;
  PortRequest out;
  int64_t port = -1;
  for (auto it = body.begin(); it != body.end(); ++it) {
    const json& v = it.value();
    if (it.key() == "sandbox") {
      if (!v.is_string()) return wrong_type("sandbox", "a string", v);
      out.ref = v.get<std::string>();
    } else if (it.key() == "port") {
      if (!v.is_number_integer()) return wrong_type("port", "an integer", v);
      port = as_int64(v);
    } else if ((it.key() == "spare_sockets" && open) || (it.key() == "count" && kind == PortRequestKind::kSockets)) {
      if (!v.is_number_unsigned() || v.get<uint64_t>() > Node::kMaxSpareSockets)
        return fail(Error::kInvalidArgument,
                    it.key() + ": an integer from 0 to " + std::to_string(Node::kMaxSpareSockets));
      out.sockets = v.get<size_t>();
    } else if (it.key() == "client" && kind != PortRequestKind::kSockets) {
      if (!v.is_string()) return wrong_type("client", "a string", v);
      out.client = v.get<std::string>();
      if (out.client.size() > kMaxClientAddressLength)
        return fail(Error::kInvalidArgument,
                    "client: at most " + std::to_string(kMaxClientAddressLength) + " characters");
    } else if (it.key() == "prewake" && kind == PortRequestKind::kLookup) {
      if (!v.is_boolean()) return wrong_type("prewake", "a boolean", v);
      out.prewake = v.get<bool>();
    } else if (it.key() == "credentials" && open) {
      if (!v.is_array()) return wrong_type("credentials", "an array of strings", v);
      if (v.size() > kMaxCredentialsPerOpen)
        return fail(Error::kInvalidArgument,
                    "credentials: at most " + std::to_string(kMaxCredentialsPerOpen) + " candidates");
      for (const json& c : v) {
        if (!c.is_string()) return wrong_type("credentials[]", "a string", c);
        out.credentials.push_back(c.get<std::string>());
      }
    } else {
      return unknown_field(it.key(), open                                 ? "sandbox, port, credentials, spare_sockets, client"
                                     : kind == PortRequestKind::kSockets ? "sandbox, port, count"
                                                                         : "sandbox, port, client, prewake");
    }
  }
  if (out.ref.empty()) return fail(Error::kInvalidArgument, "sandbox is required (an id or a name)");
  if (port < 1 || port > 65535)
    return fail(Error::kInvalidArgument, "port is required and must be between 1 and 65535");
  out.port = static_cast<uint16_t>(port);
  return out;
}

Result<std::string> parse_checkpoint(const std::string& text) {
  if (text.empty()) return std::string("filesystem");
  auto body = parse_object(text);
  if (!body) return body.failure();
  std::string type = "filesystem";
  for (auto it = body->begin(); it != body->end(); ++it) {
    if (it.key() != "type") return unknown_field(it.key(), "type");
    if (!it->is_string()) return wrong_type("type", "a string (filesystem or memory)", *it);
    type = it->get<std::string>();
  }
  return type;
}

Result<ForkRequest> parse_fork(const std::string& text) {
  ForkRequest r;
  if (text.empty()) return r;
  auto body = parse_object(text);
  if (!body) return body.failure();
  for (auto it = body->begin(); it != body->end(); ++it) {
    if (it.key() == "count") {
      if (!it->is_number_integer()) return wrong_type("count", "an integer", *it);
      int64_t n = it->get<int64_t>();
      if (n < 1 || n > kMaxForks)
        return fail(Error::kInvalidArgument, "count: must be between 1 and " + std::to_string(kMaxForks));
      r.count = static_cast<uint32_t>(n);
    } else if (it.key() == "name_prefix") {
      if (!it->is_string()) return wrong_type("name_prefix", "a string", *it);
      r.name_prefix = it->get<std::string>();
    } else {
      return unknown_field(it.key(), "count, name_prefix");
    }
  }
  return r;
}

Result<ExposeRequest> parse_expose(const std::string& text) {
  ExposeRequest r;
  if (text.empty()) return r;
  auto body = parse_object(text);
  if (!body) return body.failure();
  for (auto it = body->begin(); it != body->end(); ++it) {
    if (it.key() == "public") {
      if (!it->is_boolean()) return wrong_type("public", "true or false", *it);
      r.is_public = it->get<bool>();
    } else if (it.key() == "protocol") {
      if (!it->is_string()) return wrong_type("protocol", "a string (http1, h2c or tcp)", *it);
      r.protocol = it->get<std::string>();
    } else {
      return unknown_field(it.key(), "public, protocol");
    }
  }
  return r;
}

Result<BuildRequest> parse_build(const json& body) {
  BuildRequest r;
  constexpr std::string_view kFields = "name, from, variant, packages, steps, workdir, env, timeout_secs";
  constexpr std::string_view kStepShape =
      "an array of steps, each {\"run\": \"shell command\"} or {\"copy\": {\"source\": \"/on/the/node\", \"dest\": \"/in/the/image\"}}";
  for (auto it = body.begin(); it != body.end(); ++it) {
    const std::string& k = it.key();
    const json& v = *it;
    if (k == "name" || k == "from" || k == "variant" || k == "workdir") {
      if (!v.is_string()) return wrong_type(k, "a string", v);
      (k == "name" ? r.name : k == "from" ? r.from : k == "variant" ? r.variant : r.workdir) = v.get<std::string>();
    } else if (k == "packages" || k == "env") {
      auto list = string_list(v, k);
      if (!list) return list.failure();
      (k == "packages" ? r.packages : r.env) = std::move(*list);
    } else if (k == "steps") {
      if (!v.is_array()) return wrong_type(k, kStepShape, v);
      for (const json& s : v) {
        if (!s.is_object() || s.size() != 1) return wrong_type(k, kStepShape, v);
        BuildStep step;
        if (const json* run = s.contains("run") ? &s["run"] : nullptr; run != nullptr && run->is_string()) {
          step.run = run->get<std::string>();
        } else if (const json* c = s.contains("copy") ? &s["copy"] : nullptr;
                   c != nullptr && c->is_object() && c->size() == 2 && c->contains("source") && c->contains("dest") &&
                   (*c)["source"].is_string() && (*c)["dest"].is_string()) {
          step.kind = BuildStep::Kind::kCopy;
          step.copy = {(*c)["source"].get<std::string>(), (*c)["dest"].get<std::string>()};
        } else {
          return wrong_type(k, kStepShape, v);
        }
        r.steps.push_back(std::move(step));
      }
    } else if (k == "timeout_secs") {
      if (!v.is_number_unsigned() || v.get<uint64_t>() > kMaxBuildTimeoutSecs)
        return wrong_type(k, "an integer of 1 to " + std::to_string(kMaxBuildTimeoutSecs), v);
      r.timeout_secs = v.get<uint32_t>();
    } else {
      return unknown_field(k, kFields);
    }
  }
  if (r.name.empty()) return fail(Error::kInvalidArgument, "name is required");
  if (auto s = check_build_request(r); !s) return s.failure();
  return r;
}

Status check_api_body(ApiBody kind, const std::string& body) {
  auto outcome = [](const auto& parsed) -> Status {
    if (!parsed) return parsed.failure();
    return {};
  };
  if (kind == ApiBody::kActivity) return outcome(parse_activity(body));
  if (kind == ApiBody::kCheckpoint) return outcome(parse_checkpoint(body));
  if (kind == ApiBody::kFork) return outcome(parse_fork(body));
  if (kind == ApiBody::kExpose) return outcome(parse_expose(body));
  auto object = parse_object(body);
  if (!object) return object.failure();
  switch (kind) {
    case ApiBody::kCreate: return outcome(parse_create(*object));
    case ApiBody::kBuild: return outcome(parse_build(*object));
    case ApiBody::kOpen: return outcome(parse_port_request(*object, PortRequestKind::kOpen));
    case ApiBody::kSockets: return outcome(parse_port_request(*object, PortRequestKind::kSockets));
    case ApiBody::kLookup: return outcome(parse_port_request(*object, PortRequestKind::kLookup));
    case ApiBody::kActivity:
    case ApiBody::kCheckpoint:
    case ApiBody::kFork:
    case ApiBody::kExpose: break;  // read above, from the text
  }
  return fail(Error::kInvalidArgument, "unknown request body kind");
}

}  // namespace sg
