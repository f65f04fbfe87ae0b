// One error vocabulary for the whole project: every fallible function returns Result<T>, never throws on
// the data path. The enum is coarse on purpose (callers branch on it); the message carries the detail a
// human needs.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace sg {

enum class Error {
  kInvalidArgument,  // caller or untrusted input is malformed
  kNotFound,
  kAlreadyExists,
  kConflict,         // the request is valid but impossible in the current state (e.g. illegal transition)
  kUnsupported,      // the driver/kernel/config cannot do this
  kPermissionDenied,
  kLimitExceeded,
  kTimeout,
  kUnavailable,      // a peer (node, sandbox, kernel facility) is not reachable right now
  kUnreachable,      // the sandbox runs, but the port asked for cannot be reached in it (nothing listens there)
  kIo,               // a system call failed
  kInternal,
};

std::string_view error_name(Error e);

struct Failure {
  Error code;
  std::string message;
};

inline Failure fail(Error code, std::string message) { return Failure{code, std::move(message)}; }
// errno-based failure with the syscall name and strerror text.
Failure fail_errno(std::string_view what, int err);

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor): Result<T> r = value;
  Result(Failure f) : v_(std::move(f)) {}    // NOLINT(google-explicit-constructor)

  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }
  T& value() & { return std::get<0>(v_); }
  const T& value() const& { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() { return value(); }
  const T& operator*() const { return value(); }
  const Failure& failure() const { return std::get<1>(v_); }
  Error error() const { return failure().code; }
  const std::string& message() const { return failure().message; }

 private:
  std::variant<T, Failure> v_;
};

template <>
class [[nodiscard]] Result<void> {
 public:
  Result() = default;
  Result(Failure f) : failure_(std::move(f)), ok_(false) {}  // NOLINT(google-explicit-constructor)
  bool ok() const { return ok_; }
  explicit operator bool() const { return ok_; }
  const Failure& failure() const { return failure_; }
  Error error() const { return failure_.code; }
  const std::string& message() const { return failure_.message; }

 private:
  Failure failure_{Error::kInternal, {}};
  bool ok_ = true;
};

using Status = Result<void>;

}  // namespace sg
