#include "snapshot/checkpointer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include <spdlog/spdlog.h>

#include "common/fd.h"
#include "snapshot/checkpoint_delta.h"
#include "snapshot/layer_squash.h"

namespace sg::snapshot {
namespace {

// An index is a few dozen bytes per upper dir entry: this bounds it at the layer entry limit.
constexpr size_t kMaxIndexBytes = 512 * 1024 * 1024;
// How long the freeze may be held for the file clock to leave the newest write's tick (one or two ticks of
// 1-4 ms are enough; more means the clock was set back, and the racy marks take over).
constexpr int64_t kMaxRacyWaitNs = 20'000'000;

// The index the next delta starts from, when it is consistent: it must have been made for `base` (a
// sandbox's base layers never change, so an index made for others is not this sandbox's).
CheckpointIndex load_index(const std::string& path, const std::vector<std::string>& base) {
  CheckpointIndex fresh{base, {}, base};
  int raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (raw < 0) {
    if (errno != ENOENT) spdlog::warn("checkpoint: cannot open {} ({}); writing a full layer", path, std::strerror(errno));
    return fresh;
  }
  UniqueFd fd(raw);
  auto text = read_at_most(fd.get(), kMaxIndexBytes, path);
  if (!text) {
    spdlog::warn("checkpoint: {}; writing a full layer", text.message());
    return fresh;
  }
  auto index = decode_index(*text);
  // Written for this base: said so since flattening (whose chain no longer starts with it), and before by a
  // chain starting with it.
  const bool ours = index && (index->base.empty() ? index->chain.size() >= base.size() &&
                                                        std::equal(base.begin(), base.end(), index->chain.begin())
                                                  : index->base == base);
  if (!ours) {
    spdlog::warn("checkpoint: {} is not this sandbox's last checkpoint; writing a full layer", path);
    return fresh;
  }
  return std::move(*index);
}

// Flattens `chain` (what the checkpoint stacks on) when it is long: its layers above the image's own become
// one that shows the same tree (layer_squash.h), so the chain is at most the image's layers and two. Runs
// before the freeze (the layers never change) and keeps the previous index valid: the upper dir stacks on the
// same tree. `pinned` takes the new layer.
Status flatten_long_chain(ImageStore& images, const CheckpointJob& job, std::vector<std::string>& chain,
                          std::vector<std::string>& pinned, size_t& flattened) {
  size_t image = 0;  // how many of the chain's bottom layers are the image's
  if (auto own = images.get(job.record.image); own) {
    while (image < own->layers.size() && image < chain.size() && chain[image] == own->layers[image]) ++image;
    if (image != own->layers.size()) image = 0;  // not that image's layers as they are now: flatten all
  }
  const size_t above = chain.size() - image;
  if (chain.size() + 1 <= kMaxImageLayers && above + 1 <= job.max_layers_above_image) return {};
  if (above < 2)
    return fail(Error::kLimitExceeded, "the sandbox's root filesystem has " + std::to_string(chain.size()) +
                                           " layers, its image's alone " + std::to_string(image) + " (at most " +
                                           std::to_string(kMaxImageLayers) + ")");
  const std::vector<std::string> stack(chain.begin() + static_cast<std::ptrdiff_t>(image), chain.end());
  auto squashed = squash_layers(images, stack, "the checkpoint chain of " + job.record.source_id);
  if (!squashed) return fail(squashed.error(), "flattening " + squashed.message());
  chain.resize(image);
  if (!squashed->empty()) {
    chain.push_back(*squashed);
    pinned.push_back(*squashed);
  }
  flattened = stack.size();
  return {};
}

}  // namespace

Result<CheckpointResult> checkpoint(ImageStore& images, SnapshotStore& snapshots, const CheckpointJob& job,
                                    Freezer& freezer) {
  CheckpointIndex previous = load_index(job.index_path, job.base_layers);
  if (!images.pin_existing(previous.chain)) {
    // An earlier checkpoint's layer went with its snapshot (snapshot rm): start over from the base.
    previous = CheckpointIndex{job.base_layers, {}, job.base_layers};
    if (auto s = images.pin_existing(previous.chain); !s) return fail(s.error(), "the sandbox's " + s.message());
  }
  std::vector<std::string> pinned = previous.chain;
  struct Unpin {
    ImageStore& images;
    std::vector<std::string>& layers;
    ~Unpin() { images.unpin(layers); }  // the GC then takes a layer no record names (a failed checkpoint's)
  } unpin{images, pinned};
  CheckpointResult result;
  if (Status s = flatten_long_chain(images, job, previous.chain, pinned, result.flattened); !s) return s.failure();

  auto dir = images.layers().make_temp_dir("checkpoint-");
  if (!dir) return dir.failure();
  RemovedOnExit cleanup{*dir};
  const std::string blob = *dir + "/layer.tar";

  auto frozen_at = std::chrono::steady_clock::now();
  if (auto s = freezer.freeze(); !s) return fail(s.error(), "freeze: " + s.message());
  auto current = scan_upper(job.upper_dir, job.max_entries);
  Result<WrittenLayer> written = fail(Error::kInternal, "not written");
  int64_t racy_since = INT64_MIN;
  if (current) {
    DeltaPlan plan = plan_delta(previous.index, *current);
    LayerSource source{LayerSource::Kind::kOverlayUpper, job.upper_dir, "", job.shift, job.max_entries, &plan};
    written = write_layer(source, blob);
    racy_since = racy_threshold_after(*current, kMaxRacyWaitNs);
  }
  Status thawed = freezer.thaw();
  result.pause_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - frozen_at).count();
  if (!thawed) return fail(thawed.error(), "thaw after the checkpoint: " + thawed.message());
  if (!current) return current.failure();
  if (!written) return written.failure();

  Snapshot record = job.record;
  record.layers = previous.chain;
  result.entries = written->entries;
  if (written->entries > 0) {
    auto added = images.add_pinned_layer(blob, written->digest, "checkpoint of " + record.source_id);
    if (!added) return added.failure();
    pinned.push_back(*added);
    struct stat st{};
    if (::stat((images.layers().layer_dir(*added) + "/blob").c_str(), &st) != 0)
      return fail_errno("stat the checkpoint layer " + *added, errno);
    record.layer = *added;
    record.layer_bytes = static_cast<uint64_t>(st.st_size);
    record.layers.push_back(*added);
  }
  record.created_at_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::system_clock::now().time_since_epoch()).count();
  for (int attempt = 0;; ++attempt) {
    record.id = generate_snapshot_id();
    Status created = snapshots.create(record);
    if (created) break;
    if (created.error() != Error::kAlreadyExists || attempt == 8) return created.failure();
  }
  // After the record: an index must never describe a layer no snapshot holds. A failure here only makes the
  // next checkpoint stack on the previous index's chain (a bigger layer, still a correct one).
  mark_racy(*current, racy_since);
  if (auto s = write_file_atomic(job.index_path, encode_index({record.layers, std::move(*current), job.base_layers})); !s)
    spdlog::warn("checkpoint {}: the sandbox's index was not updated: {}", record.id, s.message());
  result.snapshot = std::move(record);
  return result;
}

}  // namespace sg::snapshot
