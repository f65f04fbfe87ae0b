#include "noderuntime/image_service.h"

#include <deque>
#include <mutex>
#include <optional>

namespace sg {
namespace {

struct Work {
  uv_work_t req;
  std::function<Result<snapshot::Image>()> job;
  ImageService::Done done;
  std::optional<Result<snapshot::Image>> result;
};

// A build's events cross from its worker thread to the loop through a queue and a uv_async_t; the queue is
// drained once more after the job ends, so `done` comes after every event.
struct BuildWork {
  uv_work_t req;
  uv_async_t async;
  ImageBuilder* builder;
  BuildRequest request;
  std::function<void(const BuildEvent&)> progress;
  ImageService::Done done;
  std::optional<Result<snapshot::Image>> result;
  std::mutex mu;
  std::deque<BuildEvent> events;

  void drain() {
    std::deque<BuildEvent> batch;
    {
      std::lock_guard lock(mu);
      batch.swap(events);
    }
    for (const BuildEvent& e : batch) progress(e);
  }
};

}  // namespace

void ImageService::build(BuildRequest request, std::function<void(const BuildEvent&)> progress, Done done) {
  auto* w = new BuildWork;
  w->req.data = w;
  w->async.data = w;
  w->builder = &builder_;
  w->request = std::move(request);
  w->progress = std::move(progress);
  w->done = std::move(done);
  if (int rc = uv_async_init(loop_, &w->async, [](uv_async_t* a) { static_cast<BuildWork*>(a->data)->drain(); }); rc < 0) {
    std::unique_ptr<BuildWork> owned(w);
    return owned->done(fail(Error::kInternal, std::string("uv_async_init: ") + uv_strerror(rc)));
  }
  auto close = [](BuildWork* w) {
    uv_close(reinterpret_cast<uv_handle_t*>(&w->async), [](uv_handle_t* h) { delete static_cast<BuildWork*>(h->data); });
  };
  int rc = uv_queue_work(
      loop_, &w->req,
      [](uv_work_t* r) {
        auto* w = static_cast<BuildWork*>(r->data);
        w->result.emplace(w->builder->build(w->request, [w](const BuildEvent& e) {
          {
            std::lock_guard lock(w->mu);
            w->events.push_back(e);
          }
          uv_async_send(&w->async);
        }));
      },
      [](uv_work_t* r, int status) {
        auto* w = static_cast<BuildWork*>(r->data);
        w->drain();
        if (status < 0 || !w->result) w->done(fail(Error::kInternal, "image build cancelled"));
        else w->done(std::move(*w->result));
        uv_close(reinterpret_cast<uv_handle_t*>(&w->async), [](uv_handle_t* h) { delete static_cast<BuildWork*>(h->data); });
      });
  if (rc < 0) {
    w->done(fail(Error::kInternal, std::string("uv_queue_work: ") + uv_strerror(rc)));
    close(w);
  }
}

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
  run([store, name = std::move(name), after = after_remove_] {
    auto removed = store->remove(name);
    if (removed && after) after();
    return removed;
  }, std::move(done));
}

}  // namespace sg
