// HTTP/2 from the client as the ingress reads it: H2RequestScanner looking for the first request (the whole
// prefix received so far, growing), then H2ClientFilter, which decodes, checks and re-encodes every HEADERS
// block of the connection. Both see the bytes in chunks sized by the input's last byte.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "proxy/h2_filter.h"
#include "proxy/h2_head.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  const size_t chunk = size == 0 ? 1 : 1 + data[size - 1] % 256;

  sg::H2RequestScanner scanner;
  for (size_t received = std::min(chunk, size);; received = std::min(received + chunk, size)) {
    auto scanned = scanner.scan(in.substr(0, received));
    if (!scanned || scanned->has_value() || received == size) break;
  }

  // Every third stream is refused, so refused streams (their later frames dropped) are covered as well.
  sg::H2ClientFilter filter(sg::H2FilterLimits{}, [](sg::H2Request& r) {
    return sg::H2Verdict{r.stream_id % 3 == 0 ? 421 : 0};
  });
  filter.set_on_malformed([](uint32_t, std::string_view) {});
  std::string to_sandbox, to_client;
  for (size_t at = 0; at < size; at += chunk) {
    if (!filter.feed(in.substr(at, std::min(chunk, size - at)), to_sandbox, to_client)) break;
    to_sandbox.clear();
    to_client.clear();
  }
  return 0;
}
