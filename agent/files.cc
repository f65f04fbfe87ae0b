#include "agent/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "common/fd.h"

namespace sg::agent {
namespace {

constexpr size_t kFileChunkBytes = 64 * 1024;

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// A file system error as an answer: the client named something missing, forbidden, or the agent failed.
void respond_errno(Responder& out, std::string_view what, const std::string& path, int err) {
  std::string message = std::string(what) + " " + path + ": " + std::strerror(err);
  if (err == ENOENT || err == ENOTDIR) return out.respond_error(404, Error::kNotFound, message);
  if (err == EACCES || err == EPERM || err == EROFS) return out.respond_error(403, Error::kPermissionDenied, message);
  if (err == ENAMETOOLONG || err == ELOOP) return out.respond_error(400, Error::kInvalidArgument, message);
  out.respond_error(500, Error::kIo, message);
}

class DownloadHandler : public Handler {
 public:
  DownloadHandler(UniqueFd fd, uint64_t size, Responder& out)
      : fd_(std::move(fd)), remaining_(size), out_(out), buf_(kFileChunkBytes) {}
  void on_body_end() override { pump(); }
  void on_drain() override { pump(); }

 private:
  // Reads only while the client keeps up, so a large file never sits in memory.
  void pump() {
    while (!done_ && remaining_ > 0 && out_.queued_bytes() <= kHighWatermark) {
      size_t want = static_cast<size_t>(std::min<uint64_t>(remaining_, buf_.size()));
      ssize_t n;
      do {
        n = ::read(fd_.get(), buf_.data(), want);
      } while (n < 0 && errno == EINTR);
      if (n <= 0) {
        // Truncated or unreadable after the Content-Length went out: a short body must not pass as whole.
        done_ = true;
        return out_.abandon();
      }
      out_.write(std::string_view(buf_.data(), static_cast<size_t>(n)));
      remaining_ -= static_cast<uint64_t>(n);
    }
    if (!done_ && remaining_ == 0) {
      done_ = true;
      out_.end();
    }
  }

  UniqueFd fd_;
  uint64_t remaining_;
  Responder& out_;
  std::vector<char> buf_;
  bool done_ = false;
};

class UploadHandler : public Handler {
 public:
  UploadHandler(std::string path, std::string temp, UniqueFd fd, bool replaces, mode_t mode, uint64_t max_bytes,
                Responder& out)
      : path_(std::move(path)), temp_(std::move(temp)), fd_(std::move(fd)), replaces_(replaces), mode_(mode),
        max_bytes_(max_bytes), out_(out) {}
  ~UploadHandler() override { discard(); }

  void on_body(std::string_view data) override {
    if (temp_.empty()) return;  // already answered
    received_ += data.size();
    if (received_ > max_bytes_)
      return reject(413, Error::kLimitExceeded, "upload exceeds " + std::to_string(max_bytes_) + " bytes");
    while (!data.empty()) {
      ssize_t n = ::write(fd_.get(), data.data(), data.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return reject(500, Error::kIo, "write " + path_ + ": " + std::strerror(errno));
      data.remove_prefix(static_cast<size_t>(n));
    }
  }

  void on_body_end() override {
    if (temp_.empty()) return;
    if (::fchmod(fd_.get(), mode_) != 0) return reject(500, Error::kIo, "chmod " + temp_ + ": " + std::strerror(errno));
    // close() is where some file systems report a failed write-back.
    if (::close(fd_.release()) != 0) return reject(500, Error::kIo, "close " + temp_ + ": " + std::strerror(errno));
    if (::rename(temp_.c_str(), path_.c_str()) != 0) {
      int err = errno;
      if (err == EISDIR) return reject(409, Error::kConflict, path_ + " is a directory");
      return reject(500, Error::kIo, "rename to " + path_ + ": " + std::strerror(err));
    }
    temp_.clear();
    if (replaces_) return out_.respond(204, {}, "");
    nlohmann::ordered_json body = {{"path", path_}, {"size", received_}};
    out_.respond(201, {{"Content-Type", "application/json"}},
                 body.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace));
  }

 private:
  void reject(int status, Error code, const std::string& message) {
    discard();
    out_.respond_error(status, code, message);
  }
  void discard() {
    if (temp_.empty()) return;
    fd_.reset();
    ::unlink(temp_.c_str());
    temp_.clear();
  }

  std::string path_;
  std::string temp_;  // empty once renamed or discarded
  UniqueFd fd_;
  bool replaces_;
  mode_t mode_;
  uint64_t max_bytes_;
  uint64_t received_ = 0;
  Responder& out_;
};

}  // namespace

Result<std::string> percent_decode(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '+') {
      out += ' ';
    } else if (s[i] == '%') {
      int hi = i + 2 < s.size() ? hex_digit(s[i + 1]) : -1;
      int lo = i + 2 < s.size() ? hex_digit(s[i + 2]) : -1;
      if (hi < 0 || lo < 0)
        return fail(Error::kInvalidArgument, "bad percent-encoding in '" + std::string(s) + "'");
      out += static_cast<char>(hi * 16 + lo);
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

Result<std::string> file_path_param(std::string_view target) {
  size_t q = target.find('?');
  std::string_view query = q == std::string_view::npos ? std::string_view() : target.substr(q + 1);
  std::optional<std::string> path;
  while (!query.empty()) {
    std::string_view pair = query.substr(0, query.find('&'));
    query.remove_prefix(std::min(query.size(), pair.size() + 1));
    std::string_view name = pair.substr(0, pair.find('='));
    if (name != "path") continue;  // other parameters are not ours to judge
    if (path) return fail(Error::kInvalidArgument, "path: given more than once");
    auto value = percent_decode(name.size() < pair.size() ? pair.substr(name.size() + 1) : std::string_view());
    if (!value) return value.failure();
    path = std::move(*value);
  }
  if (!path || path->empty()) return fail(Error::kInvalidArgument, "path is required: /files?path=/absolute/path");
  if ((*path)[0] != '/') return fail(Error::kInvalidArgument, "path must be absolute, got '" + *path + "'");
  if (path->find('\0') != std::string::npos) return fail(Error::kInvalidArgument, "path must not contain NUL bytes");
  return std::move(*path);
}

std::unique_ptr<Handler> download(const std::string& path, Responder& out) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise block the whole agent until a writer appears.
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  struct stat st {};
  if (!fd.valid() || ::fstat(fd.get(), &st) != 0) {
    respond_errno(out, "open", path, errno);
    return std::make_unique<Handler>();
  }
  if (S_ISDIR(st.st_mode)) {
    out.respond_error(409, Error::kConflict, path + " is a directory");
    return std::make_unique<Handler>();
  }
  if (!S_ISREG(st.st_mode)) {
    out.respond_error(409, Error::kConflict, path + " is not a regular file");
    return std::make_unique<Handler>();
  }
  out.start(200, {{"Content-Type", "application/octet-stream"}}, st.st_size);
  return std::make_unique<DownloadHandler>(std::move(fd), static_cast<uint64_t>(st.st_size), out);
}

std::unique_ptr<Handler> upload(const std::string& path, int64_t content_length, uint64_t max_bytes,
                                mode_t new_file_mode, Responder& out) {
  auto answered = [] { return std::make_unique<Handler>(); };
  if (path.back() == '/') {
    out.respond_error(400, Error::kInvalidArgument, "path must name a file, got the directory " + path);
    return answered();
  }
  if (content_length >= 0 && static_cast<uint64_t>(content_length) > max_bytes) {
    out.respond_error(413, Error::kLimitExceeded, "upload exceeds " + std::to_string(max_bytes) + " bytes");
    return answered();
  }
  struct stat st {};
  bool replaces = false;
  mode_t mode = new_file_mode;
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) {
      out.respond_error(409, Error::kConflict, path + " is a directory");
      return answered();
    }
    replaces = true;
    mode = st.st_mode & 07777;  // replacing a file keeps its permissions
  } else if (errno != ENOENT) {
    respond_errno(out, "stat", path, errno);
    return answered();
  }
  std::string dir = path.substr(0, path.rfind('/'));
  // The same directory, so the final rename() cannot cross file systems.
  std::string temp = dir + "/.sandgate-upload-XXXXXX";
  UniqueFd fd(::mkostemp(temp.data(), O_CLOEXEC));
  if (!fd.valid()) {
    int err = errno;
    if (err == ENOENT || err == ENOTDIR) {
      out.respond_error(404, Error::kNotFound, "directory does not exist: " + (dir.empty() ? "/" : dir));
      return answered();
    }
    respond_errno(out, "create a file in", dir.empty() ? "/" : dir, err);
    return answered();
  }
  return std::make_unique<UploadHandler>(path, std::move(temp), std::move(fd), replaces, mode, max_bytes, out);
}

}  // namespace sg::agent
