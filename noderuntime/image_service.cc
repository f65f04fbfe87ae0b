#include "noderuntime/image_service.h"

#include <optional>

namespace sg {
namespace {

struct Work {
  uv_work_t req;
  std::function<Result<snapshot::Image>()> job;
  ImageService::Done done;
  std::optional<Result<snapshot::Image>> result;
};

}  // namespace

void ImageService::run(std::function<Result<snapshot::Image>()> job, Done done) {
  auto* w = new Work;
  w->req.data = w;
  w->job = std::move(job);
  w->done = std::move(done);
  int rc = uv_queue_work(
      loop_, &w->req, [](uv_work_t* r) { static_cast<Work*>(r->data)->result.emplace(static_cast<Work*>(r->data)->job()); },
      [](uv_work_t* r, int status) {
        std::unique_ptr<Work> w(static_cast<Work*>(r->data));
        if (status < 0 || !w->result) return w->done(fail(Error::kInternal, "image job cancelled"));
        w->done(std::move(*w->result));
      });
  if (rc < 0) {
    std::unique_ptr<Work> owned(w);
    owned->done(fail(Error::kInternal, std::string("uv_queue_work: ") + uv_strerror(rc)));
  }
}

void ImageService::import(std::string archive_path, std::string name, Done done) {
  snapshot::ImageStore* store = store_.get();
  run([store, archive_path = std::move(archive_path), name = std::move(name)] { return store->import(archive_path, name); },
      std::move(done));
}

void ImageService::remove(std::string name, Done done) {
  snapshot::ImageStore* store = store_.get();
  run([store, name = std::move(name)] { return store->remove(name); }, std::move(done));
}

}  // namespace sg
