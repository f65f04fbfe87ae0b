// Incremental HTTP/1.x parsing on top of llhttp, with explicit size limits. Used for the ingress's first
// request head, the node API server, and the HTTP clients (proxy -> node, CLI -> node, driver -> hypervisor).
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"

namespace sg {

struct HttpHeader {
  std::string name;
  std::string value;
};

// First header with this name (case-insensitive), or nullptr.
const std::string* find_header(std::span<const HttpHeader> headers, std::string_view name);

struct HttpMessage {
  std::string method;  // requests
  std::string target;  // requests: the request-target as sent
  int status = 0;      // responses
  int http_major = 1;
  int http_minor = 1;
  std::vector<HttpHeader> headers;
  std::string body;
  bool upgrade = false;
  bool keep_alive = false;

  // First header with this name (case-insensitive), or nullptr.
  const std::string* header(std::string_view name) const;
};

struct HttpLimits {
  size_t max_head_bytes = 16 * 1024;
  size_t max_body_bytes = 1024 * 1024;
  // Stop once the head is parsed (the ingress forwards the rest as bytes and never reads bodies).
  bool stop_after_head = false;
};

class HttpParser {
 public:
  enum class Kind { kRequest, kResponse };
  enum class State { kNeedMore, kHeadComplete, kMessageComplete, kError };

  HttpParser(Kind kind, HttpLimits limits);
  ~HttpParser();
  HttpParser(const HttpParser&) = delete;
  HttpParser& operator=(const HttpParser&) = delete;

  // Feed the next bytes. consumed() then says how many were used: with stop_after_head the rest belongs to
  // the body; after kMessageComplete the rest belongs to the next message.
  State feed(const char* data, size_t len);
  State feed(std::string_view s) { return feed(s.data(), s.size()); }
  // The peer closed: completes a response delimited by EOF, otherwise an error if mid-message.
  State finish();
  size_t consumed() const { return consumed_; }
  const HttpMessage& message() const { return msg_; }
  HttpMessage& message() { return msg_; }
  // Valid in kError: kLimitExceeded for a head or body over its limit, kInvalidArgument for bad syntax.
  const Failure& failure() const { return failure_; }
  // The head has been parsed: a kLimitExceeded failure is then about the body.
  bool head_done() const { return !in_head_; }
  // Ready for the next message on the same connection.
  void reset();

 private:
  struct Impl;
  friend struct Impl;
  std::unique_ptr<Impl> impl_;
  HttpLimits limits_;
  HttpMessage msg_;
  State state_ = State::kNeedMore;
  Failure failure_{Error::kInternal, {}};
  size_t consumed_ = 0;
  size_t head_bytes_ = 0;
  bool in_head_ = true;
  bool last_was_value_ = false;
};

std::string_view http_reason(int status);

}  // namespace sg
