// `sandgate image build` on the node (docs/images.md): turns a BuildRequest into an image of the ImageStore,
// one step at a time, each step sealed as one layer:
//   1. the base: without `from`, a Debian bookworm root made by mmdebstrap (--mode=unshare, tar output, which
//      is the layer blob as it is) from the mirror in the host's apt sources, with the packages; with `from`,
//      that image's layers, shared (pinned for the build), and the packages as an apt-get install step;
//   2. the steps in the order given: a copy (host files the node reads, owned by image root in the layer), or
//      a run command, in a build sandbox (build_sandbox.h) over the layers so far, whose upper dir becomes the
//      layer (layer_writer.h). A step that changed nothing adds no layer.
// Everything happens in a temp dir of the layer store, removed at the end whatever happens; the image record
// is written last, so an interrupted build leaves only tmp/ debris (and unnamed layers the next start collects).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "noderuntime/build_request.h"
#include "snapshot/image_store.h"

namespace sg {

inline constexpr uint64_t kMaxBuildLayerEntries = 1'000'000;  // = the store's own bound on a layer
// Each build gets its own host id range, out of kBuildIdSlots: image id N is host id base + N.
inline constexpr uid_t kBuildIdBase = 2'000'000'000;
inline constexpr uint32_t kBuildIdCount = 65536;
inline constexpr uint32_t kBuildIdSlots = 64;


struct BuildEvent {
  enum class Kind { kStep, kOutput, kLayer } kind = Kind::kStep;
  size_t step = 0;   // 1-based
  size_t steps = 0;  // total
  std::string text;  // kStep: what the step does; kOutput: one line of its output; kLayer: the digest ("" = none)
  uint64_t size_bytes = 0;  // kLayer
};
using BuildProgress = std::function<void(const BuildEvent&)>;

// The Debian mirror in the host's apt sources (deb822 `URIs:` of a bookworm suite, or a one-line `deb URI
// bookworm ...`), else http://deb.debian.org/debian. `files` are the apt source files to read, in order.
std::string debian_mirror(const std::vector<std::string>& files);
// /etc/apt/sources.list and /etc/apt/sources.list.d/*.{list,sources}, sorted.
std::vector<std::string> host_apt_source_files();

struct BuilderOptions {
  std::string mmdebstrap = "/usr/bin/mmdebstrap";
  std::string mirror;  // "" = debian_mirror(host_apt_source_files())
};

class ImageBuilder {
 public:
  // `store` must outlive the builder. Thread-safe: builds may run at once (each takes its own id slot).
  ImageBuilder(snapshot::ImageStore* store, BuilderOptions options) : store_(store), options_(std::move(options)) {}

  // Runs on the caller's thread (a worker: minutes of work). A failing step is kInvalidArgument naming the
  // step, its exit code and its last output lines; a build past its timeout kTimeout.
  Result<snapshot::Image> build(const BuildRequest& request, const BuildProgress& progress);

 private:
  snapshot::ImageStore* store_;
  BuilderOptions options_;
  std::atomic<uint32_t> next_slot_{0};
};

}  // namespace sg
