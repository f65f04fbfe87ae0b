#include "proxy/splice_pipe.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

namespace sg {

Result<std::unique_ptr<SplicePipe>> SplicePipe::create(size_t capacity) {
  int fds[2];
  if (::pipe2(fds, O_NONBLOCK | O_CLOEXEC) != 0) return fail_errno("pipe2", errno);
  UniqueFd read_end(fds[0]);
  UniqueFd write_end(fds[1]);
  int size = ::fcntl(write_end.get(), F_SETPIPE_SZ, static_cast<int>(capacity));
  if (size < 0) size = ::fcntl(write_end.get(), F_GETPIPE_SZ);
  if (size <= 0) return fail_errno("fcntl(F_GETPIPE_SZ)", errno);
  return std::unique_ptr<SplicePipe>(
      new SplicePipe(std::move(read_end), std::move(write_end), static_cast<size_t>(size)));
}

ssize_t SplicePipe::fill(int from, uint64_t max) {
  const size_t room = capacity_ - buffered_;
  ssize_t n = ::splice(from, nullptr, write_end_.get(), nullptr, max < room ? static_cast<size_t>(max) : room,
                       SPLICE_F_NONBLOCK | SPLICE_F_MOVE);
  if (n > 0) {
    buffered_ += static_cast<size_t>(n);
  } else if (n < 0 && errno == EAGAIN && buffered_ > 0) {
    full_ = true;
  }
  return n;
}

ssize_t SplicePipe::drain(int to) {
  ssize_t n = ::splice(read_end_.get(), nullptr, to, nullptr, buffered_, SPLICE_F_NONBLOCK | SPLICE_F_MOVE);
  if (n > 0) {
    buffered_ -= static_cast<size_t>(n);
    full_ = false;
  }
  return n;
}

}  // namespace sg
