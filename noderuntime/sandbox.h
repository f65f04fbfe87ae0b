// The sandbox model shared by the node's units: what a user asked for (SandboxSpec), where it is in its
// lifecycle (SandboxState), and what a driver needs to find it again after a node restart (RuntimeInfo).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace sg {

enum class SandboxState { kCreating, kRunning, kSuspending, kSuspended, kResuming, kTerminated, kFailed };

std::string_view state_name(SandboxState s);
std::optional<SandboxState> parse_state(std::string_view s);

struct SandboxSpec {
  std::string id;    // "sb-" + 12 chars of [a-z0-9]; stable, never reused
  std::string name;  // optional, unique among live sandboxes, DNS-label rules (names.h)
  bool ephemeral = false;  // idle -> terminate instead of suspend
  std::vector<std::string> command;  // argv, non-empty
  std::map<std::string, std::string> env;
  std::string cwd = "/";
  std::vector<uint16_t> exposed_ports;
  uint32_t timeout_secs = 300;  // idle threshold: running -> suspended (memory tier)
  // Seconds in the memory tier before hibernating to disk; 0 = never. Only drivers that can hibernate use it.
  uint32_t hibernate_after_secs = 0;
  std::string driver = "process";  // Driver::name() of the driver that runs it
  double cpus = 1.0;            // CPU quota in cores (fractional allowed)
  uint32_t memory_mb = 512;
};

// Driver-owned facts persisted with the sandbox so a restarted node can find the running instance again.
struct RuntimeInfo {
  int pid = 0;                    // the sandbox's init process, as seen from the host
  uint64_t start_time_ticks = 0;  // /proc/<pid>/stat field 22: tells a live process from a reused pid
  std::string sandbox_dir;        // per-sandbox directory under the state dir (logs, driver files)
  // Anything else the driver needs to find or restore the instance (a QMP socket path, a state file, host
  // ports forwarded to guest ports). Opaque to the node; stored as a JSON object of strings.
  std::map<std::string, std::string> driver_data;
};

// Where a suspended sandbox's memory is: kept resident (paused) or saved to disk (hibernated).
enum class SuspendTier { kNone, kMemory, kDisk };

std::string_view tier_name(SuspendTier t);  // "", "memory", "disk"
std::optional<SuspendTier> parse_tier(std::string_view s);

}  // namespace sg
