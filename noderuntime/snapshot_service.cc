#include "noderuntime/snapshot_service.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <optional>

#include <spdlog/spdlog.h>

#include "common/fd.h"
#include "snapshot/layer_store.h"

namespace sg {
namespace {

template <typename T>
struct Work {
  uv_work_t req;
  std::function<Result<T>()> job;
  std::function<void(Result<T>)> done;
  std::optional<Result<T>> result;
};

}  // namespace

template <typename T>
void SnapshotService::run(std::function<Result<T>()> job, std::function<void(Result<T>)> done) {
  auto* w = new Work<T>;
  w->req.data = w;
  w->job = std::move(job);
  w->done = std::move(done);
  int rc = uv_queue_work(
      loop_, &w->req, [](uv_work_t* r) { static_cast<Work<T>*>(r->data)->result.emplace(static_cast<Work<T>*>(r->data)->job()); },
      [](uv_work_t* r, int status) {
        std::unique_ptr<Work<T>> w(static_cast<Work<T>*>(r->data));
        if (status < 0 || !w->result) return w->done(fail(Error::kInternal, "snapshot job cancelled"));
        w->done(std::move(*w->result));
      });
  if (rc < 0) {
    std::unique_ptr<Work<T>> owned(w);
    owned->done(fail(Error::kInternal, std::string("uv_queue_work: ") + uv_strerror(rc)));
  }
}

void SnapshotService::checkpoint(snapshot::CheckpointJob job, std::unique_ptr<snapshot::Freezer> freezer,
                                 CheckpointDone done) {
  snapshot::ImageStore* images = images_;
  snapshot::SnapshotStore* store = store_.get();
  // shared_ptr: std::function needs a copyable callable.
  std::shared_ptr<snapshot::Freezer> held(std::move(freezer));
  run<snapshot::CheckpointResult>(
      [images, store, job = std::move(job), held] { return snapshot::checkpoint(*images, *store, job, *held); },
      std::move(done));
}

// "ino size mtime ctime" of `path`, empty when it cannot be read: what tells a file changed since it hashed.
std::string SnapshotService::file_stamp(const std::string& path) {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) return {};
  return std::to_string(st.st_ino) + " " + std::to_string(st.st_size) + " " + std::to_string(st.st_mtim.tv_sec) +
         "." + std::to_string(st.st_mtim.tv_nsec) + " " + std::to_string(st.st_ctim.tv_sec) + "." +
         std::to_string(st.st_ctim.tv_nsec);
}

Result<std::string> SnapshotService::begin_files(const std::string& id) {
  const std::string dir = store_->new_files_dir(id);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  if (::mkdir(dir.c_str(), 0700) != 0) return fail_errno("mkdir " + dir, errno);
  return dir;
}

void SnapshotService::discard_files(const std::string& id) {
  run<bool>(
      [dir = store_->new_files_dir(id)]() -> Result<bool> {
        std::error_code ec;
        std::filesystem::remove_all(dir, ec);
        return true;
      },
      [](Result<bool>) {});
}

void SnapshotService::commit_files(snapshot::Snapshot record, Done done) {
  snapshot::SnapshotStore* store = store_.get();
  run<snapshot::Snapshot>(
      [this, store, record = std::move(record)]() -> Result<snapshot::Snapshot> {
        const std::string tmp = store->new_files_dir(record.id);
        const std::string dir = store->files_dir(record.id);
        auto sync_file = [](const std::string& path) -> Status {
          UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
          if (!fd.valid() || ::fsync(fd.get()) != 0) return fail_errno("fsync " + path, errno);
          return {};
        };
        auto discard = [&](Status why) -> Result<snapshot::Snapshot> {
          std::error_code ec;
          std::filesystem::remove_all(tmp, ec);
          std::filesystem::remove_all(dir, ec);
          return why.failure();
        };
        snapshot::Snapshot out = record;
        std::error_code ec;
        for (const auto& entry : std::filesystem::directory_iterator(tmp, ec)) {
          if (Status s = sync_file(entry.path().string()); !s) return discard(s);
          // Hashed here, after the guest runs again: a create from the snapshot checks the files against it.
          auto digest = snapshot::sha256_file(entry.path().string());
          if (!digest) return discard(digest.failure());
          out.file_digests[entry.path().filename().string()] = *digest;
        }
        if (ec) return discard(fail(Error::kIo, "read " + tmp + ": " + ec.message()));
        if (Status s = snapshot::fsync_dir(tmp); !s) return discard(s);
        if (::rename(tmp.c_str(), dir.c_str()) != 0) return discard(fail_errno("rename " + tmp, errno));
        // The record last: until it exists the files are nobody's, and the next start sweeps them. A disk
        // that reads its parent's needs that one still there (a removal may have taken it meanwhile); the
        // check and the record under remove()'s lock.
        {
          std::lock_guard lock(mu_);
          if (!out.parent.empty())
            if (auto parent = store->get(out.parent); !parent)
              return discard(fail(Error::kConflict, "snapshot " + out.parent + ", whose disk this checkpoint's reads, "
                                                    "was removed meanwhile: " + parent.message()));
          if (Status s = store->create(out); !s) return discard(s);
        }
        // Just hashed: the first create from a golden snapshot does not read its RAM file a second time.
        std::lock_guard lock(verified_mu_);
        for (const auto& [name, digest] : out.file_digests)
          if (std::string stamp = file_stamp(dir + "/" + name); !stamp.empty()) verified_[out.id + "/" + name] = stamp;
        return out;
      },
      std::move(done));
}

Result<std::vector<snapshot::Snapshot>> SnapshotService::list() const {
  auto all = store_->list();
  if (all) std::erase_if(*all, [](const snapshot::Snapshot& s) { return s.removed; });
  return all;
}

Result<snapshot::Snapshot> SnapshotService::get(std::string_view id) const {
  auto found = store_->get(id);
  if (found && found->removed) return fail(Error::kNotFound, "no snapshot " + std::string(id) + " (it was removed)");
  return found;
}

Status SnapshotService::add_user(const std::string& id, const std::string& user) {
  std::lock_guard lock(mu_);
  auto found = get(id);
  if (!found) return found.failure();
  return users_.add(id, user);  // never claimed outside mu_, which this holds: always succeeds
}

std::optional<std::string> SnapshotService::image_user(const std::string& image) const {
  auto user = store_->first_user_of_image(image);
  // A record that cannot be read might name the image: keep the image rather than guess.
  if (!user) return "a snapshot record that cannot be read (" + user.message() + ")";
  return *user;
}

void SnapshotService::verify(std::string id, std::function<void(Status)> done) {
  run<bool>(
      [this, id = std::move(id)]() -> Result<bool> {
        auto snap = get(id);
        if (!snap) return snap.failure();
        // A file that hashed right is not hashed again while it is unchanged (same inode, size, times).
        auto check = [this](const std::string& key, const std::string& path,
                            const std::function<Status()>& hash) -> Status {
          const std::string stamp = file_stamp(path);
          {
            std::lock_guard lock(verified_mu_);
            if (auto it = verified_.find(key); !stamp.empty() && it != verified_.end() && it->second == stamp) return {};
          }
          if (Status s = hash(); !s) return s;
          if (!stamp.empty()) {
            std::lock_guard lock(verified_mu_);
            verified_[key] = stamp;
          }
          return {};
        };
        auto image = images_->get(snap->image);
        for (const std::string& layer : snap->layers) {
          if (image && std::find(image->layers.begin(), image->layers.end(), layer) != image->layers.end()) continue;
          Status s = check(layer, images_->layers().layer_dir(layer) + "/blob",
                           [&] { return images_->layers().verify(layer); });
          if (!s) return fail(s.error(), "snapshot " + id + ": " + s.message());
        }
        // Its files, and those of the snapshots its disk reads (a delta's parents, removed ones too).
        std::optional<snapshot::Snapshot> at = std::move(*snap);
        for (size_t depth = 0; at; ++depth) {
          if (depth > snapshot::kMaxSnapshots)
            return fail(Error::kInvalidArgument, "snapshot " + id + ": its parents make a loop");
          for (const auto& file : at->file_digests) {
            const std::string& name = file.first;  // not a structured binding: clang 14 cannot capture one
            const std::string& digest = file.second;
            const std::string path = store_->files_dir(at->id) + "/" + name;
            const std::string whose = at->id == id ? "its" : "its parent " + at->id + "'s";
            Status s = check(at->id + "/" + name, path, [&]() -> Status {
              auto got = snapshot::sha256_file(path);
              if (!got) return got.failure();
              if (*got != digest)
                return fail(Error::kInvalidArgument, whose + " file " + name + " is corrupted: it hashes to " + *got +
                                                         ", not to the " + digest + " it was saved with");
              return {};
            });
            if (!s) return fail(s.error(), "snapshot " + id + ": " + s.message());
          }
          if (at->parent.empty()) break;
          auto parent = store_->get(at->parent);
          if (!parent) return fail(parent.error(), "snapshot " + id + ": its parent " + at->parent + ": " + parent.message());
          at = std::move(*parent);
        }
        return true;
      },
      [done = std::move(done)](Result<bool> r) { done(r ? Status() : Status(r.failure())); });
}

void SnapshotService::remove(std::string id, Done done) {
  run<snapshot::Snapshot>(
      [this, id = std::move(id)]() -> Result<snapshot::Snapshot> {
        Result<snapshot::Snapshot> found = fail(Error::kInternal, "not looked up");
        std::vector<std::string> deleted;
        {
          std::lock_guard lock(mu_);
          found = get(id);
          if (!found) return found.failure();
          if (auto user = users_.claim_for_removal(id))
            return fail(Error::kConflict, "snapshot " + id + " is in use by " + *user +
                                              " (created from it); remove that first");
          // add_user takes mu_ too, so the claim only has to last until the record is gone or marked.
          // A disk another snapshot's disk reads stays, its record marked removed; otherwise both go, and
          // so do the removed snapshots under it that were kept for it alone.
          auto child = store_->first_child_of(id);
          Status s = !child ? Status(child.failure()) : *child ? store_->mark_removed(id) : store_->remove(id);
          users_.release_removal(id);
          if (!s) return s.failure();
          found->removed = child->has_value();
          if (!found->removed) {
            deleted.push_back(id);
            for (std::string parent = found->parent; !parent.empty();) {
              auto up = store_->get(parent);
              if (!up || !up->removed) break;
              auto other = store_->first_child_of(parent);
              if (!other || *other) break;
              if (Status gone = store_->remove(parent); !gone) {
                spdlog::warn("snapshot {}: its removed parent {} stays: {}", id, parent, gone.message());
                break;
              }
              deleted.push_back(parent);
              parent = up->parent;
            }
          }
        }
        {
          std::lock_guard lock(verified_mu_);
          for (const std::string& gone : deleted)
            std::erase_if(verified_, [&](const auto& entry) { return entry.first.starts_with(gone + "/"); });
        }
        // The record is gone either way; layers left behind go at the next removal or node start.
        if (auto s = images_->collect_unused(); !s)
          spdlog::warn("snapshot {} removed, its layers not collected: {}", id, s.message());
        return found;
      },
      std::move(done));
}

}  // namespace sg
