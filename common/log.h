// Daemon logging (spdlog to stderr). The access log is separate: one JSON object per line (proxy/access_log.h).
#pragma once

#include <spdlog/spdlog.h>

#include <string_view>

namespace sg {

// Sets the default logger: "2026-11-29T10:00:00.123 info [sandgate-proxy] message" on stderr.
void init_logging(std::string_view program, std::string_view level);

}  // namespace sg
