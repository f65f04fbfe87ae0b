#include "proxy/keylog_format.h"

#include <dlfcn.h>

#include <cstdarg>
#include <cstddef>

// glibc's, exported since 2.3.4; declared here rather than through <stdio.h>, whose fortified declarations
// depend on _FORTIFY_SOURCE.
extern "C" int __vsprintf_chk(char* out, int flag, size_t out_size, const char* format, va_list args);

extern "C" __attribute__((visibility("default"))) int __sprintf_chk(char* out, int flag, size_t out_size,
                                                                    const char* format, ...) {
  va_list args;
  va_start(args, format);
  if (format[0] == '%' && format[1] == '0' && format[2] == '2' && format[3] == 'x' && format[4] == '\0' &&
      out_size >= 3) {
    unsigned value = va_arg(args, unsigned);
    if (value <= 0xff) {
      static constexpr char kDigits[] = "0123456789abcdef";
      out[0] = kDigits[value >> 4];
      out[1] = kDigits[value & 0xf];
      out[2] = '\0';
      va_end(args);
      return 2;
    }
    // Wider than two digits: glibc formats it, from the first argument again.
    va_end(args);
    va_start(args, format);
  }
  int written = __vsprintf_chk(out, flag, out_size, format, args);
  va_end(args);
  return written;
}

namespace sg {

bool keylog_hex_fast_path_in_use() {
  return dlsym(RTLD_DEFAULT, "__sprintf_chk") == reinterpret_cast<void*>(&__sprintf_chk);
}

}  // namespace sg
