#include "proxy/http1_filter.h"

#include <llhttp.h>
#include <strings.h>

#include <algorithm>

namespace sg {

const std::string* Http1Request::header(std::string_view name) const { return find_header(headers, name); }

struct Http1RequestFilter::Parser {
  llhttp_t parser{};
  llhttp_settings_t settings{};
  Http1Request request;
  bool in_head = true;
  bool last_was_value = false;
  bool upgrade = false;  // the request being forwarded asks to switch protocols (Upgrade, CONNECT)
  size_t head_bytes = 0;

  static Parser* of(llhttp_t* p) { return static_cast<Parser*>(p->data); }
  static constexpr size_t kUsualFieldCount = 16;

  Parser() {
    llhttp_settings_init(&settings);
    settings.on_method = [](llhttp_t* p, const char* at, size_t len) {
      of(p)->request.method.append(at, len);
      return 0;
    };
    settings.on_url = [](llhttp_t* p, const char* at, size_t len) {
      of(p)->request.target.append(at, len);
      return 0;
    };
    settings.on_header_field = [](llhttp_t* p, const char* at, size_t len) {
      Parser* self = of(p);
      if (self->request.headers.capacity() == 0) self->request.headers.reserve(kUsualFieldCount);
      if (self->last_was_value || self->request.headers.empty()) self->request.headers.push_back({});
      self->last_was_value = false;
      self->request.headers.back().name.append(at, len);
      return 0;
    };
    settings.on_header_value = [](llhttp_t* p, const char* at, size_t len) {
      Parser* self = of(p);
      self->last_was_value = true;
      self->request.headers.back().value.append(at, len);
      return 0;
    };
    // Pauses so feed() sees where the head ends: the head is judged (and rewritten) before a byte of it or
    // of its body is forwarded.
    settings.on_headers_complete = [](llhttp_t* p) {
      Parser* self = of(p);
      self->request.http_major = llhttp_get_http_major(p);
      self->request.http_minor = llhttp_get_http_minor(p);
      self->upgrade = llhttp_get_upgrade(p) != 0;
      return static_cast<int>(HPE_PAUSED);
    };
    // Pauses so feed() knows where the next head begins.
    settings.on_message_complete = [](llhttp_t*) { return static_cast<int>(HPE_PAUSED); };
    llhttp_init(&parser, HTTP_REQUEST, &settings);
    parser.data = this;
  }

  void next_message() {
    // The header list keeps its capacity from one request to the next: a keep-alive connection allocates it
    // once instead of growing it field by field in every request.
    std::vector<HttpHeader> headers = std::move(request.headers);
    headers.clear();
    request = Http1Request{};
    request.headers = std::move(headers);
    in_head = true;
    last_was_value = false;
    upgrade = false;
    head_bytes = 0;
  }
};

Http1RequestFilter::Http1RequestFilter(size_t max_head_bytes, OnRequest on_request)
    : parser_(std::make_unique<Parser>()),
      on_request_(std::move(on_request)),
      max_head_bytes_(max_head_bytes) {}

void Http1RequestFilter::resolve_upgrade(bool switched) {
  if (state_ != State::kAwaitingSwitch) return;
  if (switched) {
    state_ = State::kTunnel;
    return;
  }
  // The sandbox stayed with HTTP/1.1: a fresh parser reads the held bytes as the next requests.
  parser_ = std::make_unique<Parser>();
  state_ = State::kRequests;
}

Http1RequestFilter::~Http1RequestFilter() = default;

void Http1RequestFilter::release_memory_while_idle() {
  // Once a head was judged and forwarded (in_head false: its body, if any, passes as it comes) nothing reads
  // it again; an empty one holds only the list's capacity. A head being read keeps what was parsed of it.
  if (!parser_->in_head) parser_->request = Http1Request{};
  else if (parser_->request.headers.empty()) std::vector<HttpHeader>().swap(parser_->request.headers);
}

void ask_to_close(std::vector<HttpHeader>& headers) {
  std::string value = "close";
  auto is_connection = [](const HttpHeader& h) { return strcasecmp(h.name.c_str(), "connection") == 0; };
  for (const HttpHeader& h : headers) {
    if (!is_connection(h)) continue;
    std::string_view rest = h.value;
    while (!rest.empty()) {
      const size_t comma = rest.find(',');
      std::string_view option = rest.substr(0, comma);
      rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
      while (!option.empty() && (option.front() == ' ' || option.front() == '\t')) option.remove_prefix(1);
      while (!option.empty() && (option.back() == ' ' || option.back() == '\t')) option.remove_suffix(1);
      auto is = [&](std::string_view word) {
        return option.size() == word.size() && strncasecmp(option.data(), word.data(), word.size()) == 0;
      };
      if (option.empty() || is("close") || is("keep-alive")) continue;
      value.append(", ").append(option);
    }
  }
  std::erase_if(headers, is_connection);
  headers.push_back({"Connection", std::move(value)});
}

bool Http1RequestFilter::between_requests() const {
  return state_ == State::kRequests && held_.empty() && parser_->in_head && parser_->head_bytes == 0;
}

namespace {

// The request announced a body (a CONNECT never has one that llhttp would read).
bool has_body(const llhttp_t& p) {
  if (p.method == HTTP_CONNECT) return false;
  return (p.flags & F_CHUNKED) || ((p.flags & F_CONTENT_LENGTH) && p.content_length > 0);
}

size_t count_fields(const Http1Request& r, std::string_view name) {
  return static_cast<size_t>(std::count_if(r.headers.begin(), r.headers.end(), [&](const HttpHeader& h) {
    return h.name.size() == name.size() && strncasecmp(h.name.data(), name.data(), name.size()) == 0;
  }));
}

}  // namespace

Http1RequestFilter::State Http1RequestFilter::feed(std::string_view in, std::string& out) {
  Parser& p = *parser_;
  auto refuse = [&](int status, std::string reason) {
    state_ = State::kRefused;
    refusal_ = {status, std::move(reason)};
    return state_;
  };
  if (state_ == State::kAwaitingSwitch) {
    if (held_.size() + in.size() > kMaxHeldBytes)
      return refuse(400, "more than " + std::to_string(kMaxHeldBytes) +
                             " bytes sent after an Upgrade request before the sandbox answered it");
    held_.append(in);
    return state_;
  }
  if (!held_.empty()) {
    // Released by resolve_upgrade: those bytes came first.
    std::string released = std::move(held_);
    held_.clear();
    released.append(in);
    if (state_ == State::kTunnel) {
      out.append(released);
      return state_;
    }
    return feed(released, out);  // kRequests; held_ is empty now, so this does not come back here
  }
  while (!in.empty() && state_ == State::kRequests) {
    // Only as much as can still be head goes to llhttp while in a head, so an endless head is cut off at
    // the limit rather than buffered.
    const size_t take = p.in_head ? std::min(in.size(), max_head_bytes_ + 1 - p.head_bytes) : in.size();
    const llhttp_errno_t err = llhttp_execute(&p.parser, in.data(), take);
    const size_t used =
        err == HPE_OK ? take : static_cast<size_t>(llhttp_get_error_pos(&p.parser) - in.data());
    if (err != HPE_OK && err != HPE_PAUSED && err != HPE_PAUSED_UPGRADE)
      return refuse(400, std::string("malformed HTTP request: ") + llhttp_get_error_reason(&p.parser));
    if (p.in_head) {
      p.head_bytes += used;
      in.remove_prefix(used);
      if (err == HPE_OK) {
        if (p.head_bytes > max_head_bytes_)
          return refuse(431, "request head exceeds " + std::to_string(max_head_bytes_) + " bytes");
        continue;
      }
      // The head is complete (HPE_PAUSED from on_headers_complete).
      llhttp_resume(&p.parser);
      p.in_head = false;
      // RFC 9112 §3.2: an HTTP/1.1 request has exactly one Host; two would let the edge and the sandbox's
      // server each believe a different one.
      const size_t hosts = count_fields(p.request, "host");
      if (hosts > 1 || (hosts == 0 && p.request.http_minor >= 1))
        return refuse(400, hosts > 1 ? "more than one Host header" : "missing Host header");
      p.request.upgrade = p.upgrade;
      Http1Verdict verdict = on_request_(p.request);
      if (verdict.refuse_status != 0) return refuse(verdict.refuse_status, std::move(verdict.reason));
      append_request_head(p.request, out);
      ++forwarded_;
      if (p.upgrade && !has_body(p.parser)) {
        // What follows is the new protocol's or the next request: it waits for the sandbox's answer.
        state_ = State::kAwaitingSwitch;
        break;
      }
      continue;
    }
    // Body bytes, chunk framing included, go as they came.
    out.append(in.data(), used);
    in.remove_prefix(used);
    if (err == HPE_PAUSED_UPGRADE || (err == HPE_PAUSED && p.upgrade)) {
      if (err == HPE_PAUSED) llhttp_resume_after_upgrade(&p.parser);
      state_ = State::kAwaitingSwitch;
      break;
    }
    if (err == HPE_PAUSED) {  // the message is complete: a new head follows
      llhttp_resume(&p.parser);
      p.next_message();
    }
  }
  if (state_ == State::kTunnel) out.append(in.data(), in.size());
  if (state_ == State::kAwaitingSwitch) {
    if (in.size() > kMaxHeldBytes)
      return refuse(400, "more than " + std::to_string(kMaxHeldBytes) +
                             " bytes sent after an Upgrade request before the sandbox answered it");
    held_.append(in.data(), in.size());
  }
  return state_;
}

void append_request_head(const Http1Request& r, std::string& out) {
  size_t size = r.method.size() + r.target.size() + 16;
  for (const HttpHeader& h : r.headers) size += h.name.size() + h.value.size() + 4;
  out.reserve(out.size() + size);
  // Versions are single digits (llhttp accepts nothing else).
  out.append(r.method).append(" ").append(r.target).append(" HTTP/");
  out.push_back(static_cast<char>('0' + r.http_major % 10));
  out.push_back('.');
  out.push_back(static_cast<char>('0' + r.http_minor % 10));
  out.append("\r\n");
  for (const HttpHeader& h : r.headers) out.append(h.name).append(": ").append(h.value).append("\r\n");
  out.append("\r\n");
}

std::string serialize_request_head(const Http1Request& r) {
  std::string out;
  append_request_head(r, out);
  return out;
}

}  // namespace sg
