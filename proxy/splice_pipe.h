// A pipe used as the in-kernel buffer between two sockets: splice(2) moves bytes socket -> pipe -> socket
// without copying them through user space. One per direction of a forwarded connection.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "common/error.h"
#include "common/fd.h"

namespace sg {

class SplicePipe {
 public:
  // A non-blocking pipe resized to `capacity` bytes (F_SETPIPE_SZ). A refused resize (the per-user pipe
  // page limit) is not an error: the pipe keeps the kernel's default size and still works.
  static Result<std::unique_ptr<SplicePipe>> create(size_t capacity);

  // Moves what `from` has, up to the free room and at most `max` bytes, into the pipe. Returns the bytes
  // moved, 0 at EOF, or -1 with errno set (EAGAIN: nothing to move now).
  ssize_t fill(int from, uint64_t max = UINT64_MAX);
  // Moves buffered bytes into `to`; a short move leaves the rest buffered, in order. Same returns as fill.
  ssize_t drain(int to);

  size_t buffered() const { return buffered_; }
  size_t capacity() const { return capacity_; }
  // Whether reading the source into the pipe can make progress. A pipe has a fixed number of slots and a
  // socket's packets can take one slot each however small they are, so the pipe can be full with fewer
  // than capacity() bytes in it. A fill that would block while bytes are buffered is therefore taken as
  // "full" until a drain frees room; polling the source meanwhile would spin on EAGAIN.
  bool accepts_more() const { return !full_ && buffered_ < capacity_; }

 private:
  SplicePipe(UniqueFd read_end, UniqueFd write_end, size_t capacity)
      : read_end_(std::move(read_end)), write_end_(std::move(write_end)), capacity_(capacity) {}

  UniqueFd read_end_;
  UniqueFd write_end_;
  size_t capacity_;
  size_t buffered_ = 0;
  bool full_ = false;
};

}  // namespace sg
