#include "common/secret_file.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>

#include "common/fd.h"

namespace sg {

Result<std::string> read_secret_file(const std::string& path, std::string_view setting, size_t max_bytes) {
  const std::string what(setting);
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return fail_errno(what + ": cannot open " + path, errno);
  struct stat st{};
  if (::fstat(fd.get(), &st) != 0) return fail_errno(what + ": cannot stat " + path, errno);
  if (!S_ISREG(st.st_mode)) return fail(Error::kInvalidArgument, what + ": " + path + " is not a regular file");
  // A copy others can read is a leak waiting to happen, so it is refused rather than served with. The mode is
  // checked on the open descriptor, so a file swapped in between the check and the read cannot slip through.
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return fail(Error::kPermissionDenied, what + ": " + path + " has mode " + mode +
                                              ", so group or others can access it; it must be readable by its "
                                              "owner only: chmod 600 " + path);
  }
  auto text = read_at_most(fd.get(), max_bytes, what + ": cannot read " + path);
  if (!text) return text.failure();
  if (text->size() > max_bytes) {
    OPENSSL_cleanse(text->data(), text->size());
    return fail(Error::kInvalidArgument, what + ": " + path + " is larger than " + std::to_string(max_bytes) + " bytes");
  }
  return std::move(*text);
}

}  // namespace sg
