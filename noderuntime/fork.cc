#include "noderuntime/fork.h"

#include <memory>

#include <spdlog/spdlog.h>

namespace sg {
namespace {

constexpr size_t kMaxLabel = 63;

struct ForkRun {
  Node* node = nullptr;
  ForkRequest request;
  std::string prefix;
  ForkResult result;
  std::function<void(Result<ForkResult>)> done;
};

void create_next(std::shared_ptr<ForkRun> run);

// Removes the forks made so far, newest first, then answers `why`.
void roll_back(std::shared_ptr<ForkRun> run, Failure why) {
  if (run->result.sandboxes.empty()) return run->done(std::move(why));
  SandboxInfo last = std::move(run->result.sandboxes.back());
  run->result.sandboxes.pop_back();
  run->node->remove(last.spec.id, [run, why = std::move(why), id = last.spec.id](Result<SandboxInfo> removed) mutable {
    if (!removed) spdlog::warn("fork: removing {} after a failed fork: {}", id, removed.message());
    roll_back(std::move(run), std::move(why));
  });
}

void create_next(std::shared_ptr<ForkRun> run) {
  const size_t made = run->result.sandboxes.size();
  if (made == run->request.count) return run->done(std::move(run->result));
  CreateRequest create;
  create.snapshot_id = run->result.snapshot.id;
  if (!run->prefix.empty()) create.name = run->prefix + "-" + std::to_string(made + 1);
  run->node->create(create, [run, made](Result<SandboxInfo> info) {
    if (!info) {
      const std::string message = "fork " + std::to_string(made + 1) + " of " + std::to_string(run->request.count) +
                                  ": " + info.message() + " (the forks made before it are removed; snapshot " +
                                  run->result.snapshot.id + " stays)";
      return roll_back(run, fail(info.error(), message));
    }
    run->result.sandboxes.push_back(std::move(*info));
    create_next(run);
  });
}

}  // namespace

std::string default_fork_prefix(const std::string& source_name) {
  if (source_name.empty()) return "";
  std::string prefix = source_name + "-fork";
  // "-<n>" takes up to 3 more characters (kMaxForks is 64).
  return prefix.size() + 3 <= kMaxLabel ? prefix : "";
}

void fork_sandbox(Node& node, std::string ref, ForkRequest request, std::function<void(Result<ForkResult>)> done) {
  auto run = std::make_shared<ForkRun>();
  run->node = &node;
  run->request = std::move(request);
  run->done = std::move(done);
  node.checkpoint(ref, "memory", [run](Result<snapshot::CheckpointResult> checkpoint) {
    if (!checkpoint) return run->done(fail(checkpoint.error(), "cannot fork: " + checkpoint.message()));
    run->result.snapshot = std::move(checkpoint->snapshot);
    run->prefix = run->request.name_prefix ? *run->request.name_prefix
                                           : default_fork_prefix(run->result.snapshot.source_name);
    create_next(run);
  });
}

}  // namespace sg
