#include "common/fd.h"

#include <cerrno>

namespace sg {

Result<std::string> read_at_most(int fd, size_t max_bytes, std::string_view what) {
  std::string text(max_bytes + 1, '\0');
  size_t got = 0;
  while (got < text.size()) {
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
