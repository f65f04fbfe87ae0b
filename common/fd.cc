#include "common/fd.h"

#include <algorithm>
#include <cerrno>

namespace sg {

Result<std::string> read_at_most(int fd, size_t max_bytes, std::string_view what) {
  // The buffer grows with what arrives: a limit of 512 MiB (a checkpoint's index) once cost every read of a
  // few KiB a 512 MiB allocation zeroed, 1.4 s per checkpoint.
  const size_t limit = max_bytes + 1;
  std::string text;
  size_t got = 0;
  while (got < limit) {
    if (got == text.size()) text.resize(std::min(limit, std::max<size_t>(text.size() * 2, 16 * 1024)));
    ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail_errno(what, errno);
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  text.resize(got);
  return text;
}

}  // namespace sg
