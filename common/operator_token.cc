#include "common/operator_token.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>

#include "common/fd.h"

namespace sg {
namespace {

std::string trim(std::string s) {
  const char* ws = " \t\r\n\v\f";
  size_t end = s.find_last_not_of(ws);
  if (end == std::string::npos) return {};
  size_t begin = s.find_first_not_of(ws);
  return s.substr(begin, end + 1 - begin);
}

}  // namespace

Result<std::string> read_operator_token(const std::string& path) {
  if (path.empty()) return std::string();
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return fail_errno("operator_token_file: cannot open " + path, errno);
  struct stat st{};
  if (::fstat(fd.get(), &st) != 0) return fail_errno("operator_token_file: cannot stat " + path, errno);
  if (!S_ISREG(st.st_mode))
    return fail(Error::kInvalidArgument, "operator_token_file: " + path + " is not a regular file");
  // The token opens every sandbox and (over node.api_listen) the whole API: a copy others can read is a leak
  // waiting to happen, so it is refused rather than served with. The mode is checked on the open descriptor,
  // so a file swapped in between the check and the read cannot slip through.
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return fail(Error::kPermissionDenied, "operator_token_file: " + path + " has mode " + mode +
                                              ", so group or others can access it; it must be readable by its "
                                              "owner only: chmod 600 " + path);
  }
  auto text = read_at_most(fd.get(), kMaxOperatorTokenBytes, "operator_token_file: cannot read " + path);
  if (!text) return text.failure();
  if (text->size() > kMaxOperatorTokenBytes)
    return fail(Error::kInvalidArgument, "operator_token_file: " + path + " is larger than " +
                                             std::to_string(kMaxOperatorTokenBytes) + " bytes; it must hold one token");
  std::string token = trim(std::move(*text));
  if (token.empty()) return fail(Error::kInvalidArgument, "operator_token_file: " + path + " holds no token");
  return token;
}

}  // namespace sg
