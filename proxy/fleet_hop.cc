#include "proxy/fleet_hop.h"

#include <algorithm>
#include <vector>

namespace sg::fleet {
namespace {

constexpr std::string_view kMagic = "SANDGATE-HOP/1";
constexpr size_t kMaxHostBytes = 253;
constexpr size_t kMaxClientBytes = 64;

bool host_char(char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '.'; }
bool client_char(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F') || c == '.' || c == ':' ||
         c == '[' || c == ']';
}

std::vector<std::string_view> split_spaces(std::string_view line) {
  std::vector<std::string_view> out;
  size_t i = 0;
  while (i < line.size()) {
    size_t j = line.find(' ', i);
    if (j == std::string_view::npos) j = line.size();
    out.push_back(line.substr(i, j - i));
    i = j + 1;
  }
  return out;
}

// The first line of `buffered`, bounded by `max` bytes including its CRLF.
Result<std::optional<std::string_view>> take_line(std::string_view buffered, size_t max, std::string_view what,
                                                  size_t* consumed) {
  size_t end = buffered.find("\r\n");
  if (end == std::string_view::npos) {
    if (buffered.size() >= max)
      return fail(Error::kLimitExceeded, std::string(what) + " longer than " + std::to_string(max) + " bytes");
    return std::optional<std::string_view>();
  }
  if (end + 2 > max)
    return fail(Error::kLimitExceeded, std::string(what) + " longer than " + std::to_string(max) + " bytes");
  *consumed = end + 2;
  return std::optional<std::string_view>(buffered.substr(0, end));
}

}  // namespace

bool valid_node_name(std::string_view name) {
  if (name.empty() || name.size() > kMaxNodeNameBytes || name.front() == '-' || name.back() == '-') return false;
  return std::all_of(name.begin(), name.end(),
                     [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-'; });
}

std::string encode_preamble(const Preamble& p) {
  const char* protocol = p.protocol == HopProtocol::kHttp2 ? "h2" : p.protocol == HopProtocol::kTcp ? "tcp" : "h1";
  return std::string(kMagic) + " " + p.host + " " + protocol + " " + p.client + "\r\n";
}

Result<std::optional<Preamble>> parse_preamble(std::string_view buffered, size_t* consumed) {
  size_t used = 0;
  auto line = take_line(buffered, kMaxPreambleBytes, "hop preamble", &used);
  if (!line) return line.failure();
  if (!*line) return std::optional<Preamble>();
  auto f = split_spaces(**line);
  if (f.size() != 4 || f[0] != kMagic) return fail(Error::kInvalidArgument, "not a hop preamble");
  Preamble p;
  if (f[1].empty() || f[1].size() > kMaxHostBytes || !std::all_of(f[1].begin(), f[1].end(), host_char))
    return fail(Error::kInvalidArgument, "hop preamble: bad host");
  p.host = std::string(f[1]);
  if (f[2] == "h1") p.protocol = HopProtocol::kHttp1;
  else if (f[2] == "h2") p.protocol = HopProtocol::kHttp2;
  else if (f[2] == "tcp") p.protocol = HopProtocol::kTcp;
  else return fail(Error::kInvalidArgument, "hop preamble: protocol must be h1, h2 or tcp");
  if (f[3].empty() || f[3].size() > kMaxClientBytes || !std::all_of(f[3].begin(), f[3].end(), client_char))
    return fail(Error::kInvalidArgument, "hop preamble: bad client address");
  p.client = std::string(f[3]);
  *consumed = used;
  return std::optional<Preamble>(std::move(p));
}

std::string encode_answer(const Answer& a) {
  switch (a.kind) {
    case Answer::Kind::kOk: return std::string(kMagic) + " ok\r\n";
    case Answer::Kind::kRedirect: return std::string(kMagic) + " redirect " + a.node + "\r\n";
    case Answer::Kind::kGone: return std::string(kMagic) + " gone " + a.node + "\r\n";
  }
  return {};
}

Result<std::optional<Answer>> parse_answer(std::string_view buffered, size_t* consumed) {
  size_t used = 0;
  auto line = take_line(buffered, kMaxAnswerBytes, "hop answer", &used);
  if (!line) return line.failure();
  if (!*line) return std::optional<Answer>();
  auto f = split_spaces(**line);
  if (f.empty() || f[0] != kMagic) return fail(Error::kInvalidArgument, "not a hop answer");
  Answer a;
  if (f.size() == 2 && f[1] == "ok") {
    a.kind = Answer::Kind::kOk;
  } else if (f.size() == 3 && (f[1] == "redirect" || f[1] == "gone") && valid_node_name(f[2])) {
    a.kind = f[1] == "redirect" ? Answer::Kind::kRedirect : Answer::Kind::kGone;
    a.node = std::string(f[2]);
  } else {
    return fail(Error::kInvalidArgument, "hop answer: expected ok, redirect <node> or gone <node>");
  }
  *consumed = used;
  return std::optional<Answer>(std::move(a));
}

Decision decide(const Directory* directory, std::string_view self, std::string_view sandbox) {
  if (!directory) return {};
  auto owner = directory->owner_of(sandbox);
  if (!owner || owner->node == self) return {};
  Decision d;
  d.owner = owner->node;
  if (!owner->node_info || owner->node_info->ingress.empty()) {
    d.kind = Decision::Kind::kOwnerGone;
    return d;
  }
  d.kind = Decision::Kind::kRemote;
  d.node = std::move(owner->node_info);
  d.ports = std::move(owner->ports);
  return d;
}

RedirectAction on_redirect(int redirects_followed, bool sent_upstream, std::string_view to, std::string_view self) {
  if (sent_upstream || redirects_followed >= kMaxRedirects) return RedirectAction::kRefuse;
  return to == self ? RedirectAction::kRetryLocal : RedirectAction::kRetryRemote;
}

}  // namespace sg::fleet
