#include "common/failpoint.h"

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace sg {
namespace {

const std::vector<std::string>& armed() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    const char* env = std::getenv("SANDGATE_FAILPOINTS");
    std::string_view list = env != nullptr ? env : "";
    while (!list.empty()) {
      size_t comma = list.find(',');
      std::string_view name = list.substr(0, comma);
      if (!name.empty()) out.emplace_back(name);
      list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 1);
    }
    return out;
  }();
  return names;
}

}  // namespace

bool failpoints_armed() { return !armed().empty(); }

void failpoint(std::string_view name) {
  for (const std::string& n : armed()) {
    if (n != name) continue;
    // write(2), not the logger: nothing buffered may stand between this line and the kill.
    std::string line = "failpoint " + std::string(name) + ": SIGKILL\n";
    (void)!::write(STDERR_FILENO, line.data(), line.size());
    ::kill(::getpid(), SIGKILL);
  }
}

}  // namespace sg
