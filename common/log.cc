#include "common/log.h"

#include <spdlog/sinks/stdout_sinks.h>

namespace sg {

void init_logging(std::string_view program, std::string_view level) {
  auto logger = spdlog::stderr_logger_mt(std::string(program));
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %l [%n] %v");
  logger->set_level(spdlog::level::from_str(std::string(level)));
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(std::move(logger));
}

}  // namespace sg
