// What the agent's in-process tests share: a command's output and status, and an NDJSON stream split into
// its events.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace sg::agent::test_support {

struct Ran {
  int status = -1;
  std::string out;
};

// Runs `command` with the shell; its stdout and exit status (-1 if it did not exit normally).
inline Ran run(const std::string& command) {
  Ran r;
  FILE* f = ::popen(command.c_str(), "r");
  if (f == nullptr) return r;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) r.out.append(buf, n);
  int st = ::pclose(f);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

// One JSON value per non-empty line (a line that is not JSON becomes a discarded value).
inline std::vector<nlohmann::json> ndjson(const std::string& text) {
  std::vector<nlohmann::json> events;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    if (nl > pos) events.push_back(nlohmann::json::parse(text.substr(pos, nl - pos), nullptr, false));
    pos = nl + 1;
  }
  return events;
}

}  // namespace sg::agent::test_support
