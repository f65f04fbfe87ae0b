// The node API's JSON request bodies: every input goes through each route's parser (they share the JSON
// parse, then each checks its own fields), so one corpus covers them all.
#include <cstddef>
#include <cstdint>
#include <string>

#include "noderuntime/api_request.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string body(reinterpret_cast<const char*>(data), size);
  for (sg::ApiBody kind : {sg::ApiBody::kCreate, sg::ApiBody::kBuild, sg::ApiBody::kOpen, sg::ApiBody::kSockets,
                           sg::ApiBody::kLookup, sg::ApiBody::kActivity, sg::ApiBody::kCheckpoint, sg::ApiBody::kFork,
                           sg::ApiBody::kExpose})
    (void)sg::check_api_body(kind, body);
  return 0;
}
