// HTTP/1 request heads as the ingress and the node API read them: the llhttp-based HttpParser (whole
// messages with bodies, pipelined, as the node API reads them; heads only, as the ingress reads the first one)
// and the connection-long Http1RequestFilter, fed in chunks so heads split anywhere are covered too.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/http.h"
#include "proxy/http1_filter.h"

namespace {

void parse_messages(sg::HttpLimits limits, std::string_view in) {
  sg::HttpParser parser(sg::HttpParser::Kind::kRequest, limits);
  for (;;) {
    sg::HttpParser::State state = parser.feed(in);
    if (state == sg::HttpParser::State::kNeedMore) {
      (void)parser.finish();
      return;
    }
    // After a head (stop_after_head) the rest is body bytes the ingress forwards unparsed.
    if (state != sg::HttpParser::State::kMessageComplete || parser.consumed() == 0) return;
    in.remove_prefix(parser.consumed());
    parser.reset();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  parse_messages(sg::HttpLimits{.max_head_bytes = 4096, .max_body_bytes = 4096}, in);
  parse_messages(sg::HttpLimits{.max_head_bytes = 4096, .stop_after_head = true}, in);

  // The chunk size comes from the input (its last byte), so the fuzzer explores the splits as well.
  const size_t chunk = size == 0 ? 1 : 1 + data[size - 1] % 64;
  // Requests whose target mentions "refuse" are refused, so the refused state is reached as well.
  sg::Http1RequestFilter filter(
      4096,
      [](sg::Http1Request& r) {
        return r.target.find("refuse") == std::string::npos ? sg::Http1Verdict{} : sg::Http1Verdict{421, "fuzz"};
      });
  std::string out;
  for (size_t at = 0; at < size && filter.state() != sg::Http1RequestFilter::State::kRefused; at += chunk) {
    if (filter.state() == sg::Http1RequestFilter::State::kAwaitingSwitch) filter.resolve_upgrade(data[at] & 1);
    filter.feed(in.substr(at, std::min(chunk, size - at)), out);
    out.clear();
  }
  return 0;
}
