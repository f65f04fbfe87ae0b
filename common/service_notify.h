// systemd readiness (Type=notify units, deploy/systemd/): a daemon says READY=1 once it serves, RELOADING=1
// then READY=1 around a SIGHUP reload, and STOPPING=1 when it begins to stop, each with a STATUS= line that
// `systemctl status` shows. Through libsystemd's sd_notify: without $NOTIFY_SOCKET (not under systemd) every
// call does nothing.
#pragma once

#include <string_view>

namespace sg {

void notify_ready(std::string_view status);
void notify_reloading();
void notify_stopping(std::string_view status);

}  // namespace sg
