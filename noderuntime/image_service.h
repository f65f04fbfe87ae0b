// The node's images (snapshot/image_store.h) behind the libuv loop: import, build and remove unpack, make or
// delete whole layer trees, seconds to minutes of work, so they run on libuv's thread pool and answer on the
// loop (a build's progress events too, as they come); list and get only read small files and answer at once.
// Kept out of Node (node.cc): images have no sandbox state yet.
#pragma once

#include <uv.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "noderuntime/image_builder.h"
#include "snapshot/image_store.h"

namespace sg {

class ImageService {
 public:
  using Done = std::function<void(Result<snapshot::Image>)>;

  // `loop` must outlive the service; so must the service every job it started (the loop runs them to the end).
  ImageService(uv_loop_t* loop, std::unique_ptr<snapshot::ImageStore> store, BuilderOptions builder = {})
      : loop_(loop), store_(std::move(store)), builder_(store_.get(), std::move(builder)) {}

  // `done` runs on the loop thread.
  void import(std::string archive_path, std::string name, Done done);
  void remove(std::string name, Done done);
  // Runs after each successful remove, on its pool thread, before `done` is called: what the node keeps
  // made from images' layers (the QEMU driver's base disks) goes with them.
  void set_after_remove(std::function<void()> fn) { after_remove_ = std::move(fn); }
  // `progress` runs on the loop thread for each event, in order, all before `done`. A build occupies one
  // thread of libuv's pool for its whole length (UV_THREADPOOL_SIZE bounds the builds that run at once).
  void build(BuildRequest request, std::function<void(const BuildEvent&)> progress, Done done);
  Result<std::vector<snapshot::Image>> list() const { return store_->list(); }
  Result<snapshot::Image> get(const std::string& name) const { return store_->get(name); }

 private:
  void run(std::function<Result<snapshot::Image>()> job, Done done);

  uv_loop_t* loop_;
  std::unique_ptr<snapshot::ImageStore> store_;
  ImageBuilder builder_;
  std::function<void()> after_remove_;
};

}  // namespace sg
