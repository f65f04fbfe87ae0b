// `sandgate fork` / POST /v1/sandboxes/NAME/fork: a memory checkpoint of a running sandbox, then `count`
// sandboxes created from it, one after another, each continuing the source's processes under its own id,
// token, hostname and RNG state (the driver gives each its identity, driver.h checkpoint_memory).
//
// All or nothing for the sandboxes: when a create fails, the forks made before it are removed and the answer
// is the error; the snapshot stays (the user's to create from again, or to remove).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "common/error.h"
#include "noderuntime/api_request.h"
#include "noderuntime/node.h"

namespace sg {

struct ForkResult {
  snapshot::Snapshot snapshot;
  std::vector<SandboxInfo> sandboxes;  // with their tokens, in creation order
};

// The forks' names without a name_prefix: the source's name followed by "-fork" and the number, or none
// (ids only) when the source has no name or that would not fit a DNS label.
std::string default_fork_prefix(const std::string& source_name);

// `done` runs on the node's loop. `node` must outlive the operation (its callbacks are dropped with it).
void fork_sandbox(Node& node, std::string ref, ForkRequest request, std::function<void(Result<ForkResult>)> done);

}  // namespace sg
