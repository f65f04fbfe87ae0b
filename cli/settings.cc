#include "cli/settings.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include "cli/commands.h"
#include "cli/ssh.h"
#include "common/fd.h"

namespace sg::cli {
namespace {

// An ingress file holds three short lines; anything near this size is not one.
constexpr size_t kMaxIngressFileBytes = 64 * 1024;

}  // namespace

Environment process_environment() {
  return [](const char* name) {
    const char* v = std::getenv(name);
    return std::string(v != nullptr ? v : "");
  };
}

std::string setting(const std::string& flag, const Environment& env, const char* name, std::string_view fallback) {
  if (!flag.empty()) return flag;
  if (std::string v = env(name); !v.empty()) return v;
  return std::string(fallback);
}

Result<std::string> read_small_file(const std::string& path, size_t max_bytes) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd.valid()) {
    if (errno == ENOENT) return fail(Error::kNotFound, path + " does not exist");
    return fail_errno("open " + path, errno);
  }
  auto text = read_at_most(fd.get(), max_bytes, "read " + path);
  if (text && text->size() > max_bytes)
    return fail(Error::kInvalidArgument, path + " is larger than " + std::to_string(max_bytes) + " bytes");
  return text;
}

std::string ingress_file_path(const ApiAddress& api) {
  if (api.kind != ApiAddress::Kind::kDirect || api.endpoint.kind != Endpoint::Kind::kUnix) return "";
  // parse_api_address only accepts absolute socket paths, so there is always a '/'.
  const std::string& sock = api.endpoint.path;
  return sock.substr(0, sock.rfind('/') + 1) + std::string(kIngressFileName);
}

Result<IngressSettings> parse_ingress_file(std::string_view text, const std::string& path) {
  IngressSettings out;
  size_t line_no = 0;
  while (!text.empty()) {
    ++line_no;
    size_t nl = text.find('\n');
    std::string_view line = trim(text.substr(0, nl));
    text.remove_prefix(nl == std::string_view::npos ? text.size() : nl + 1);
    if (line.empty() || line.front() == '#') continue;
    auto bad = [&](const std::string& why) {
      return fail(Error::kInvalidArgument, path + ":" + std::to_string(line_no) + ": " + why +
                                               "; fix or remove the file, or override it with --ingress / "
                                               "SANDGATE_INGRESS");
    };
    size_t eq = line.find('=');
    if (eq == std::string_view::npos) return bad("expected key=value");
    std::string_view key = trim(line.substr(0, eq));
    std::string value(trim(line.substr(eq + 1)));
    if (key == "ingress") {
      if (auto s = parse_ingress(value); !s) return bad(s.message());
      out.ingress = std::move(value);
    } else if (key == "cacert") {
      if (!value.starts_with("/")) return bad("cacert must be an absolute path, got '" + value + "'");
      out.cacert = std::move(value);
    } else if (key == "domain") {
      if (auto s = validate_domain(value); !s) return bad(s.message());
      out.domain = std::move(value);
    }
  }
  return out;
}

Result<ResolvedIngress> resolve_ingress(const IngressSettings& flags, const Environment& env, const std::string& file) {
  IngressSettings from_file;
  bool have_file = false;
  if (!file.empty()) {
    auto text = read_small_file(file, kMaxIngressFileBytes);
    if (text) {
      auto parsed = parse_ingress_file(*text, file);
      if (!parsed) return parsed.failure();
      from_file = std::move(*parsed);
      have_file = true;
    } else if (text.error() != Error::kNotFound) {
      return fail(text.error(), "cannot read the ingress file: " + text.message());
    }
  }
  ResolvedIngress out;
  IngressSettings& s = out.settings;
  s.ingress = setting(flags.ingress, env, "SANDGATE_INGRESS", from_file.ingress);
  s.cacert = setting(flags.cacert, env, "SANDGATE_CACERT", from_file.cacert);
  s.domain = setting(flags.domain, env, "SANDGATE_DOMAIN", from_file.domain);
  if (!flags.ingress.empty()) {
    out.ingress_from = "--ingress";
  } else if (!env("SANDGATE_INGRESS").empty()) {
    out.ingress_from = "SANDGATE_INGRESS";
  } else if (have_file && !from_file.ingress.empty()) {
    out.ingress_from = file;
  } else {
    s.ingress = std::string(kDefaultIngress);
  }
  if (s.domain.empty()) s.domain = std::string(kDefaultDomain);
  return out;
}

}  // namespace sg::cli
