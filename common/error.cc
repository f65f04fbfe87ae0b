#include "common/error.h"

#include <cstring>
#include <string>

namespace sg {

std::string_view error_name(Error e) {
  switch (e) {
    case Error::kInvalidArgument: return "invalid_argument";
    case Error::kNotFound: return "not_found";
    case Error::kAlreadyExists: return "already_exists";
    case Error::kConflict: return "conflict";
    case Error::kUnsupported: return "unsupported";
    case Error::kPermissionDenied: return "permission_denied";
    case Error::kLimitExceeded: return "limit_exceeded";
    case Error::kTimeout: return "timeout";
    case Error::kUnavailable: return "unavailable";
    case Error::kUnreachable: return "unreachable";
    case Error::kIo: return "io";
    case Error::kInternal: return "internal";
  }
  return "unknown";
}

Failure fail_errno(std::string_view what, int err) {
  std::string msg(what);
  msg += ": ";
  msg += std::strerror(err);
  return Failure{err == ETIMEDOUT ? Error::kTimeout : Error::kIo, std::move(msg)};
}

}  // namespace sg
