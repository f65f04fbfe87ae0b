#include "common/service_notify.h"

#include <systemd/sd-daemon.h>

#include <cstring>
#include <string>

#include <spdlog/spdlog.h>

namespace sg {
namespace {

void notify(const std::string& message) {
  // < 0: the socket is set but unusable. Worth a line (the unit would then time out), never fatal.
  if (int r = sd_notify(0, message.c_str()); r < 0) spdlog::warn("sd_notify: {}", std::strerror(-r));
}

}  // namespace

void notify_ready(std::string_view status) { notify("READY=1\nSTATUS=" + std::string(status)); }

void notify_reloading() { notify("RELOADING=1\nSTATUS=reloading the configuration"); }

void notify_stopping(std::string_view status) { notify("STOPPING=1\nSTATUS=" + std::string(status)); }

}  // namespace sg
