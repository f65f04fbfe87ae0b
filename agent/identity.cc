#include "agent/identity.h"

#include <fcntl.h>
#include <linux/random.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <memory>

#include "common/fd.h"

namespace sg::agent {

std::string sandbox_identity(const char* path) {
  UniqueFd fd(::open(path, O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return {};
  char buf[128];
  ssize_t n = ::read(fd.get(), buf, sizeof buf);
  if (n <= 0) return {};
  std::string id(buf, static_cast<size_t>(n));
  id = id.substr(0, id.find_first_of("\r\n"));
  if (id.empty() || id.size() > 64) return {};
  for (char c : id)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_')) return {};
  return id;
}

Result<std::string> decode_seed(std::string_view hex) {
  if (hex.size() % 2 != 0 || hex.size() < 16 || hex.size() > 2 * kMaxSeedBytes)
    return fail(Error::kInvalidArgument, "a seed is 8 to " + std::to_string(kMaxSeedBytes) +
                                             " bytes as an even number of hex digits, got " +
                                             std::to_string(hex.size()) + " characters");
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  for (size_t i = 0; i < hex.size(); i += 2) {
    int hi = digit(hex[i]), lo = digit(hex[i + 1]);
    if (hi < 0 || lo < 0) return fail(Error::kInvalidArgument, "the seed has a character that is not a hex digit");
    out += static_cast<char>(hi << 4 | lo);
  }
  return out;
}

Status reseed_rng(std::string_view hex) {
  auto seed = decode_seed(hex);
  if (!seed) return seed.failure();
  UniqueFd fd(::open("/dev/urandom", O_WRONLY | O_CLOEXEC));
  if (!fd.valid()) return fail_errno("open /dev/urandom", errno);
  // struct rand_pool_info ends in a flexible array: one allocation holds the header and the bytes.
  std::unique_ptr<char[]> raw(new char[sizeof(rand_pool_info) + seed->size()]);
  auto* info = reinterpret_cast<rand_pool_info*>(raw.get());
  info->entropy_count = static_cast<int>(seed->size() * 8);
  info->buf_size = static_cast<int>(seed->size());
  std::memcpy(info->buf, seed->data(), seed->size());
  if (::ioctl(fd.get(), RNDADDENTROPY, info) != 0) return fail_errno("ioctl RNDADDENTROPY", errno);
  if (::ioctl(fd.get(), RNDRESEEDCRNG) != 0) return fail_errno("ioctl RNDRESEEDCRNG", errno);
  return {};
}

}  // namespace sg::agent
