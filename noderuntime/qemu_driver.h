// The QEMU driver: each sandbox is a `qemu-system-x86_64 -M microvm` guest booting Debian's cloud kernel and
// the busybox initramfs of deploy/build-guest-image.sh, which runs the sandbox's command. Controlled over QMP
// (noderuntime/qmp_client.h) on a unix socket in the sandbox directory.
//
//   start     = make sure the guest image exists (noderuntime/guest_image.h: built on first use), spawn
//               QEMU, wait for "SANDGATE-GUEST-READY" on the serial console (a file in the sandbox dir) up to
//               node.qemu_boot_timeout_ms; a stalled boot is killed and retried up to
//               node.qemu_boot_attempts times. A QEMU that exits during boot fails the start at once.
//   pause     = QMP stop;   resume = QMP cont, then the guest clock is set (below)
//   hibernate = QMP migrate to "exec:cat > <dir>/qemu.state.tmp", query-migrate until it completes; fsync and
//               rename to <dir>/qemu.state (the point of no return), then quit / SIGKILL. Cancelled (or failed)
//               before the rename: migrate_cancel, the .tmp is removed, the VM stays paused.
//   restore   = spawn QEMU with the same devices plus `-incoming defer -S`, QMP migrate-incoming
//               "exec:cat <state>", wait until loaded, cont, set the clock, then remove the state file: the
//               running guest has moved on, so restoring it again after a crash would roll the guest back.
//   terminate = SIGKILL (a disk's overlay is removed with the sandbox dir, so nothing needs flushing); a
//               hibernated sandbox has nothing to kill.
//               The VM's network namespace goes with its QEMU; its egress chain (internet access) is removed.
//
// Root filesystem: with an image (SandboxSpec::image: the create's `image`, node.qemu_image by default), the
// guest boots a disk made from it
// (noderuntime/guest_disk.h: a shared read-only ext4 base per image plus the sandbox's qcow2 overlay, made at
// start before the first boot attempt and kept in driver_data, so restores and restarted nodes use the
// same one); the initramfs mounts it (`sg.root=/dev/vda`), and runs the agent and the command chrooted into
// it. QEMU flushes the disk when a migration completes, so a hibernated VM's state file and overlay agree.
// Without an image (node.qemu_image empty and none asked for), the initramfs is the whole root filesystem.
//
// Plain migration of the whole RAM (not memory-backend-file + x-ignore-shared): the state is one
// self-contained file of about the guest's touched memory, the guest's RAM is anonymous memory that is really
// freed when hibernated, and a running guest never writes back to disk.
//
// The boundary (docs/security.md, "QEMU sandbox boundary"):
//   - Each QEMU runs in a network namespace of its own (noderuntime/netns.h), created by the driver for each
//     spawn (a boot attempt, a restore) with only its loopback up, and kept open by fd. A restarted node
//     finds it again through /proc/<pid>/ns/net of the adopted QEMU; a hibernated VM's died with its QEMU
//     and the restored one gets a new one.
//   - QEMU user networking (slirp, guest 10.0.2.15). Without internet access with restrict=on: the guest
//     reaches nothing outside itself, not the host's loopback, not other VMs. With it (allow_internet_access)
//     without restrict: the namespace is attached to the node's egress (noderuntime/sandbox_egress.h, the
//     process driver's too) before QEMU starts, so slirp's sockets for the guest's connections leave
//     through the slot's veth and the sandbox's nftables chain (deny_out, allow_out, node.deny_out, the
//     always-denied link-local range, never the host). Each new namespace (a restore) is attached again;
//     terminate removes the chain. Every exposed port, the agent port and the clock port get a
//     `hostfwd=tcp:127.0.0.1:<port>-:<port>` whose listener is on the namespace's loopback, so nothing of
//     the VM listens in the host's namespace. open_socket() creates the proxy's socket inside the namespace
//     (a setns() pair) and hands it over unconnected with that port (kept in driver_data). Only the ports
//     known at start are forwarded.
//   - The command script (env, cwd, argv) reaches the guest as the fw_cfg file kGuestCommandFwCfg, written
//     0600 in the sandbox dir, never on QEMU's command line (which any local user can read in /proc).
//   - The QMP socket and the command file are in the sandbox dir, which the driver keeps at 0700.
//   - SSH without an sshd (docs/ssh.md): the agent in the guest serves it on agent port + 1, forwarded like
//     the agent port. The sandbox's host key (made once, in <sandbox dir>/ssh, as for a process sandbox)
//     reaches the guest at boot as the fw_cfg file kGuestSshHostKeyFwCfg; the node's registered keys come
//     with the identity line (below), which also carries the host key again: a sandbox started from a
//     memory snapshot runs its source's guest, which must take the new sandbox's key.
//
// Guest clock: a stopped VM's clock stops too, so after a resume or restore the guest is behind by the time
// it spent suspended. The guest's init listens on guest port kClockGuestPort; the driver connects to its
// forward inside the VM's namespace and writes the host's epoch seconds, and the guest runs `date -s @N`.
// The same line tells the guest who it is, after every start, resume and restore and whenever the node's
// SSH keys change: "<epoch> <sandbox id> <hostname> <seed hex> <host key> <authorized_keys> <sequence>
// <secret>". The key fields are base64 (no line breaks), "-" for none (a guest without SSH: both). Lines may
// overtake each other in the guest (each connection gets a handler of its own); the sequence (the wall
// clock in ns) lets it keep the newest keys. The listener is reachable from inside the guest too, so the
// guest applies only a line that carries the secret the driver made for this boot (0600 in the sandbox
// dir) and handed to the guest as the fw_cfg file kGuestIdentitySecretFwCfg, which only its root can read;
// the guest reads it there for each line, so a sandbox started from a memory snapshot checks its own.
// A guest that prints kGuestIdentityMarker at boot answers each line once its clock (and SSH files) are
// applied, and a start, resume or restore waits for that answer (at most kIdentityAckMs) before it lets
// requests through: the first request after a wake sees the right time. A sandbox started from a memory
// snapshot inherits the answering from its source (a file next to the snapshot's state).
//
// Acceleration: node.qemu_accel = "auto" means TCG; "kvm" must be asked for explicitly. /dev/kvm existing
// proves nothing (on nested or paravirtualised hosts it may refuse ordinary guests), and a wrong guess would
// fail every boot. Under TCG the kernel cannot calibrate its TSC on microvm (no PIT/HPET), so the driver
// measures the host TSC (which TCG guests read) once and passes tsc_early_khz.
#pragma once

#include <uv.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "noderuntime/driver.h"

namespace sg {

// The guest port the init's clock listener uses (forwarded like any exposed port).
inline constexpr uint16_t kClockGuestPort = kQemuIdentityPort;
// The fw_cfg file that carries the sandbox's command script (env, cwd, argv) to the guest's init, and its
// limit: it is copied into the guest's RAM (a tmpfs) before it runs.
inline constexpr const char* kGuestCommandFwCfg = "opt/sandgate/command";
inline constexpr size_t kMaxGuestCommandBytes = 256 * 1024;
// The fw_cfg file that carries the sandbox's SSH host key to the guest's init at boot.
inline constexpr const char* kGuestSshHostKeyFwCfg = "opt/sandgate/ssh_host_key";
// The fw_cfg file that carries the secret every identity line must carry (64 hex digits, new each boot).
inline constexpr const char* kGuestIdentitySecretFwCfg = "opt/sandgate/identity_secret";
// The guest prints this line on its serial console once its network is up and the command is started.
inline constexpr const char* kGuestReadyMarker = "SANDGATE-GUEST-READY";
// Printed before the ready line: "SANDGATE-GUEST-AGENT listening|none|failed" (does the agent listen?).
inline constexpr const char* kGuestAgentMarker = "SANDGATE-GUEST-AGENT";
// Printed before the ready line: "SANDGATE-GUEST-IDENTITY answers" (it answers each identity line).
inline constexpr const char* kGuestIdentityMarker = "SANDGATE-GUEST-IDENTITY answers";
// What Linux prints when the initramfs does not fit in the guest's RAM (it then panics, finding no root).
inline constexpr const char* kInitramfsTooLarge = "Initramfs unpacking failed";

class SandboxEgress;

// The layer trees (bottom first) of the image named `name`, or why there are none (the node's image store).
using ImageLayers = std::function<Result<std::vector<std::string>>(const std::string& name)>;

// `agent_port` is Config::agent_port: forwarded into every guest (the agent listens there when the image
// has one). Missing kernel/initrd files are not an error here: start() builds them, or fails each sandbox
// with the reason. `image_layers` resolves a sandbox's image (unused by sandboxes without one). `egress` is
// the node's (it must outlive the driver), shared with the process driver; null refuses internet access.
std::unique_ptr<Driver> make_qemu_driver(uv_loop_t* loop, const NodeConfig& cfg, uint16_t agent_port,
                                         ImageLayers image_layers = nullptr, SandboxEgress* egress = nullptr);

}  // namespace sg
