// The route parser on a host name as it arrives in SNI, a Host header or :authority (any bytes).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "proxy/route.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view host(reinterpret_cast<const char*>(data), size);
  (void)sg::parse_route(host, "sandbox.localhost");
  // normalize_host is what the connection compares Host and :authority with the SNI by; its output is
  // routed too, since a normalized name must be a name parse_route copes with.
  (void)sg::parse_route(sg::normalize_host(host), "sandbox.localhost");
  return 0;
}
