// The config loader on any text: what an operator's typo (or a truncated file) gives it must come back as
// an error naming the line, never a crash. Relative paths resolve under a directory that does not exist, so
// nothing on this machine is read through them.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "config/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  (void)sg::load_config_string(text, "fuzz.toml", "/nonexistent-sandgate-fuzz");
  return 0;
}
