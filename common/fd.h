// RAII owner of a file descriptor.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>

#include "common/error.h"

namespace sg {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(std::exchange(o.fd_, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

// Reads `fd` to its end, but never more than max_bytes + 1 bytes: a result longer than max_bytes means the
// file is over the caller's limit. Errors are fail_errno(what, errno).
Result<std::string> read_at_most(int fd, size_t max_bytes, std::string_view what);

}  // namespace sg
