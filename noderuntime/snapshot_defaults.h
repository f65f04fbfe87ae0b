// What a snapshot carries of its source sandbox and gives a sandbox made from it (docs/snapshots.md): the
// record's create defaults, taken from the source's spec when it is checkpointed, and filled into a create
// request that leaves them out. Pure functions: Node (node.cc) only calls them.
#pragma once

#include "common/error.h"
#include "noderuntime/create_spec.h"
#include "noderuntime/sandbox.h"
#include "snapshot/snapshot_store.h"

namespace sg {

// The record a filesystem checkpoint of `spec` writes: type, source, driver, image, command, env, cwd and
// every exposed port with its effective policy. The checkpoint fills in the id, layers and times.
snapshot::Snapshot snapshot_record(const SandboxSpec& spec);

// `request` (naming `snap`) with the snapshot's image and driver, and its command, env (the request's keys
// win), cwd and ports where the request has none. kInvalidArgument when the request names another image or
// driver: the layers are the snapshot's, so are those.
Status apply_snapshot_defaults(const snapshot::Snapshot& snap, CreateRequest& request);

}  // namespace sg
