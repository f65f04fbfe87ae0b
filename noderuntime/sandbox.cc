#include "noderuntime/sandbox.h"

#include <algorithm>

namespace sg {

std::string_view state_name(SandboxState s) {
  switch (s) {
    case SandboxState::kCreating: return "creating";
    case SandboxState::kRunning: return "running";
    case SandboxState::kSuspending: return "suspending";
    case SandboxState::kSuspended: return "suspended";
    case SandboxState::kResuming: return "resuming";
    case SandboxState::kTerminated: return "terminated";
    case SandboxState::kFailed: return "failed";
  }
  return "unknown";
}

std::optional<SandboxState> parse_state(std::string_view s) {
  for (auto st : {SandboxState::kCreating, SandboxState::kRunning, SandboxState::kSuspending, SandboxState::kSuspended,
                  SandboxState::kResuming, SandboxState::kTerminated, SandboxState::kFailed})
    if (state_name(st) == s) return st;
  return std::nullopt;
}

std::string_view tier_name(SuspendTier t) {
  switch (t) {
    case SuspendTier::kNone: return "";
    case SuspendTier::kMemory: return "memory";
    case SuspendTier::kDisk: return "disk";
  }
  return "";
}

std::optional<SuspendTier> parse_tier(std::string_view s) {
  for (auto t : {SuspendTier::kNone, SuspendTier::kMemory, SuspendTier::kDisk})
    if (tier_name(t) == s) return t;
  return std::nullopt;
}

std::string_view protocol_name(PortProtocol p) {
  switch (p) {
    case PortProtocol::kHttp1: return "http1";
    case PortProtocol::kH2c: return "h2c";
    case PortProtocol::kTcp: return "tcp";
  }
  return "http1";
}

std::optional<PortProtocol> parse_protocol(std::string_view s) {
  for (auto p : {PortProtocol::kHttp1, PortProtocol::kH2c, PortProtocol::kTcp})
    if (protocol_name(p) == s) return p;
  return std::nullopt;
}

std::optional<PortPolicy> port_policy(const SandboxSpec& spec, uint16_t port) {
  if (std::find(spec.exposed_ports.begin(), spec.exposed_ports.end(), port) != spec.exposed_ports.end()) {
    PortPolicy out{port, false, PortProtocol::kHttp1};
    for (const PortPolicy& p : spec.ports)
      if (p.port == port) out = p;
    out.is_public = out.is_public || spec.allow_unauthenticated_access;
    return out;
  }
  if (spec.agent_port != 0 && port == spec.agent_port)
    return PortPolicy{port, false, PortProtocol::kH2c};  // see allow_unauthenticated_access
  // Never public, like the agent port: the SSH keys do their own auth, but the edge asks for the token first.
  if (port == kSshPort && agent_ssh_port(spec) != 0) return PortPolicy{port, false, PortProtocol::kTcp};
  return std::nullopt;
}

uint16_t agent_ssh_port(const SandboxSpec& spec) {
  if ((spec.driver != "process" && spec.driver != "qemu") || spec.agent_port == 0 || spec.agent_port == 65535)
    return 0;
  return static_cast<uint16_t>(spec.agent_port + 1);
}

std::optional<std::string> reserved_port(const SandboxSpec& spec, int64_t port) {
  if (spec.agent_port != 0 && port == spec.agent_port)
    return "the agent's port (agent_port), which is always reachable with the sandbox's token";
  if (agent_ssh_port(spec) != 0 && port == agent_ssh_port(spec))
    return "the agent's SSH port, which port 22 reaches with the sandbox's token (docs/ssh.md)";
  if (spec.driver == "qemu" && port == kQemuIdentityPort) return "the guest's identity listener, the node's only";
  return std::nullopt;
}

uint16_t sandbox_port(const SandboxSpec& spec, uint16_t port) {
  if (port != kSshPort) return port;
  bool exposed = std::find(spec.exposed_ports.begin(), spec.exposed_ports.end(), port) != spec.exposed_ports.end();
  return exposed || agent_ssh_port(spec) == 0 ? port : agent_ssh_port(spec);
}

}  // namespace sg
