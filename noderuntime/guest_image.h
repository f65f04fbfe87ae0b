// Makes sure the QEMU driver's guest kernel and initramfs exist before a boot, preparing them on first use
// with deploy/build-guest-image.sh, so `sandgate create --driver qemu` needs no manual step.
//
// The first ensure() of the node process decides, from what is on disk:
//   - kernel or initrd missing: build them. The starts wait; a failed build fails them with its cause and
//     the next step, and the next ensure() tries again.
//   - both there with the builder's ".stamp" beside them: refresh. The script compares its inputs (kernel
//     package, itself, busybox, the agent binary) with the stamp and returns at once when they match, so an
//     image built without the agent, or with an older agent, is rebuilt and an up-to-date one is not. A
//     failed refresh keeps the existing image (logged).
//   - both there without a stamp: made by hand; used as it is, never touched.
// After a success later calls only check that the files are still there. The builder runs only when
// node.guest_image_autobuild is on and the files are "vmlinuz" and "initrd.img" in one directory (the
// script's output layout; the default <state_dir>/guest is), otherwise a missing file fails the start with
// the command that builds it.
//
// The builder runs asynchronously (uv_spawn: the node's loop never waits) in its own process group, killed
// when it outlives timeout_ms or the GuestImage; single-flight (every ensure() during a build waits for that
// build). The sandgate-agent is passed every time, so the stamp covers it. Each line the builder prints goes
// to the node log, which is how the quickstart's terminal shows the progress of the first QEMU sandbox.
#pragma once

#include <uv.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/error.h"
#include "config/config.h"

namespace sg {

// build-guest-image.sh's exit status when Debian's kernel package cannot be resolved or downloaded.
inline constexpr int kGuestImageNoKernelPackage = 77;

struct GuestImageOptions {
  std::string kernel;  // the files the driver boots
  std::string initrd;
  bool autobuild = true;
  std::string builder;        // build-guest-image.sh; empty = not found
  std::string builder_tried;  // where it was looked for (for the message when not found)
  std::string agent;          // sandgate-agent for the image; empty = none found (the image then has none)
  std::string agent_tried;
  uint32_t timeout_ms = 20 * 60 * 1000;  // a first build downloads ~40 MB from the Debian mirrors
};

// The options a node with `cfg` uses: node.guest_kernel / guest_initrd / guest_image_*, the agent as the
// process driver finds it (node.agent_path or next to sandgate-node).
GuestImageOptions guest_image_options(const NodeConfig& cfg);

class GuestImage {
 public:
  using Done = std::function<void(Status)>;

  GuestImage(uv_loop_t* loop, GuestImageOptions options);
  // Kills a build in flight; the waiting callbacks are dropped (their owner is being torn down too).
  ~GuestImage();
  GuestImage(const GuestImage&) = delete;
  GuestImage& operator=(const GuestImage&) = delete;

  // `done` runs on the loop, never before ensure() returns: ok once the kernel and initrd exist (built if
  // needed), or why they cannot be had (kUnsupported: missing and not buildable here; kUnavailable: the
  // build failed; kTimeout).
  void ensure(Done done);

 private:
  struct Build;
  bool files_exist() const;
  std::string missing_file() const;
  bool buildable() const;
  void start_build(bool refresh);
  void on_output(std::string_view chunk);
  void maybe_finish();
  Status build_result() const;
  void settle(Status s);
  void settle_later(Done done, Status s);

  uv_loop_t* loop_;
  GuestImageOptions options_;
  std::string dir_;      // the builder's OUT_DIR: the directory of kernel and initrd
  bool checked_ = false;  // the builder ran (or was not needed) in this process
  std::unique_ptr<Build> build_;
  std::vector<Done> waiters_;
  uv_timer_t* later_ = nullptr;  // delivers results decided without a build
  std::vector<std::pair<Done, Status>> later_queue_;
};

}  // namespace sg
