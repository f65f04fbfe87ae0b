#include "agent/identity_listener.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cctype>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "agent/identity.h"
#include "agent/server.h"
#include "common/base64.h"
#include "common/fd.h"

namespace sg::agent {
namespace {

std::vector<std::string_view> split_spaces(std::string_view line) {
  std::vector<std::string_view> out;
  while (!line.empty()) {
    size_t space = line.find(' ');
    if (space != 0) out.push_back(line.substr(0, space));
    if (space == std::string_view::npos) break;
    line.remove_prefix(space + 1);
  }
  return out;
}

template <typename T>
bool parse_number(std::string_view s, T* out) {
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && end == s.data() + s.size();
}

bool is_word(std::string_view s, size_t max, std::string_view extra) {
  if (s.empty() || s.size() > max) return false;
  for (char c : s)
    if (!std::isalnum(static_cast<unsigned char>(c)) && extra.find(c) == std::string_view::npos) return false;
  return true;
}

// `bytes` into `path`, whole or not at all (a new file renamed over the old), readable by root only.
Status write_private(const std::string& path, std::string_view bytes) {
  const std::string tmp = path + ".new";
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  if (!fd.valid()) return fail_errno("open " + tmp, errno);
  if (::fchmod(fd.get(), 0600) != 0) return fail_errno("chmod " + tmp, errno);
  while (!bytes.empty()) {
    ssize_t n = ::write(fd.get(), bytes.data(), bytes.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail_errno("write " + tmp, errno);
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  fd.reset();
  if (::rename(tmp.c_str(), path.c_str()) != 0) return fail_errno("rename " + tmp, errno);
  return {};
}

std::string read_secret(const std::string& path) {
  std::ifstream in(path);
  std::string secret;
  in >> secret;
  return secret;
}

}  // namespace

Result<IdentityLine> parse_identity_line(std::string_view line) {
  auto bad = [](const std::string& why) { return fail(Error::kInvalidArgument, "identity line: " + why); };
  auto f = split_spaces(line);
  if (f.size() != 8) return bad("8 fields expected, got " + std::to_string(f.size()));
  IdentityLine out;
  if (!parse_number(f[0], &out.epoch) || out.epoch <= 0) return bad("the time is not a positive number");
  if (!is_word(f[1], 64, "-_")) return bad("the sandbox id is not an id");
  if (!is_word(f[2], 64, "-_.")) return bad("the hostname is not a host name");
  out.id = f[1];
  out.hostname = f[2];
  if (f[3] != "-") {
    if (auto seed = decode_seed(f[3]); !seed) return bad(seed.message());
    out.seed_hex = f[3];
  }
  for (auto [field, into, present] : {std::tuple{f[4], &out.host_key, &out.has_host_key},
                                      std::tuple{f[5], &out.authorized_keys, static_cast<bool*>(nullptr)}}) {
    if (field == "-") continue;
    auto bytes = base64_decode(field);
    if (!bytes) return bad("a key field: " + bytes.message());
    *into = std::move(*bytes);
    if (present != nullptr) *present = true;
  }
  if (!parse_number(f[6], &out.sequence)) return bad("the sequence is not a number");
  out.secret = f[7];
  return out;
}

Status IdentitySystem::set_clock(int64_t epoch) {
  const timespec now{static_cast<time_t>(epoch), 0};
  if (::clock_settime(CLOCK_REALTIME, &now) != 0) return fail_errno("clock_settime", errno);
  return {};
}

Status IdentitySystem::set_hostname(const std::string& name) {
  if (::sethostname(name.data(), name.size()) != 0) return fail_errno("sethostname", errno);
  return {};
}

Status IdentitySystem::reseed(const std::string& seed_hex) { return reseed_rng(seed_hex); }

Status IdentitySystem::sync_filesystems() {
  ::sync();
  return {};
}

std::string IdentityListener::apply(std::string_view text) {
  if (text.starts_with("sync ")) {
    const std::string secret = read_secret(paths_.secret_file);
    const std::string_view given = text.substr(5);
    if (secret.empty() || secret.size() != given.size() || CRYPTO_memcmp(secret.data(), given.data(), secret.size()) != 0)
      return "";
    if (Status s = system_->sync_filesystems(); !s) {
      std::fprintf(stderr, "sandgate-agent: sync: %s\n", s.message().c_str());
      return "failed sync\n";
    }
    return "ok\n";
  }
  auto line = parse_identity_line(text);
  if (!line) {
    std::fprintf(stderr, "sandgate-agent: %s\n", line.message().c_str());
    return "";
  }
  const std::string secret = read_secret(paths_.secret_file);
  if (secret.empty() || secret.size() != line->secret.size() ||
      CRYPTO_memcmp(secret.data(), line->secret.data(), secret.size()) != 0)
    return "";  // not from the node that booted this guest: dropped, unanswered
  std::string failed;
  auto step = [&failed](const char* what, const Status& s) {
    if (s) return;
    std::fprintf(stderr, "sandgate-agent: identity: %s: %s\n", what, s.message().c_str());
    if (failed.empty()) failed = what;
  };
  // The clock first: the wake's first request may be served right after the answer.
  step("clock", system_->set_clock(line->epoch));
  if (!paths_.ssh_host_key.empty() && line->sequence > last_keys_sequence_) {
    Status keys = line->has_host_key ? write_private(paths_.ssh_host_key, line->host_key) : Status();
    if (keys) keys = write_private(paths_.ssh_authorized_keys, line->authorized_keys);
    if (keys) last_keys_sequence_ = line->sequence;
    step("ssh-files", keys);
  }
  step("hostname", system_->set_hostname(line->hostname));
  if (!line->seed_hex.empty()) {
    Status reseeded = system_->reseed(line->seed_hex);
    if (reseeded)
      std::fprintf(stderr, "sandgate-agent: kernel RNG reseeded with %zu bytes from the node (sandbox %s)\n",
                   line->seed_hex.size() / 2, line->id.c_str());
    step("reseed", reseeded);
  }
  if (!paths_.id_file.empty()) step("id", write_private(paths_.id_file, line->id + "\n"));
  return failed.empty() ? "ok\n" : "failed " + failed + "\n";
}

// ---- the listener ----

struct IdentityListener::Client {
  explicit Client(IdentityListener* o) : owner(o) {}
  IdentityListener* owner;
  uv_tcp_t tcp{};
  uv_write_t write{};
  std::string in, answer;
  bool closing = false;  // the line was taken (or refused): whatever arrives after it is ignored

  void close() {
    auto* handle = reinterpret_cast<uv_handle_t*>(&tcp);
    if (uv_is_closing(handle)) return;
    closing = true;
    owner->clients_.erase(this);
    uv_close(handle, [](uv_handle_t* h) { delete static_cast<Client*>(h->data); });
  }
  void on_read(ssize_t n, const char* data) {
    if (closing) return;
    if (n < 0) return close();  // the end (or an error) before a whole line: nothing is applied
    in.append(data, static_cast<size_t>(n));
    const size_t newline = in.find('\n');
    if (newline == std::string::npos) {
      if (in.size() > kMaxIdentityLineBytes) close();
      return;
    }
    closing = true;
    uv_read_stop(reinterpret_cast<uv_stream_t*>(&tcp));
    answer = owner->apply(std::string_view(in).substr(0, newline));
    if (answer.empty()) return close();
    uv_buf_t out = uv_buf_init(answer.data(), static_cast<unsigned>(answer.size()));
    if (uv_write(&write, reinterpret_cast<uv_stream_t*>(&tcp), &out, 1,
                 [](uv_write_t* w, int) { static_cast<Client*>(w->handle->data)->close(); }) != 0)
      close();
  }
};

IdentityListener::IdentityListener(uv_loop_t* loop, IdentityPaths paths, IdentitySystem* system)
    : loop_(loop), paths_(std::move(paths)), system_(system) {}

IdentityListener::~IdentityListener() = default;

Status IdentityListener::listen(const Endpoint& ep) {
  listening_ = true;  // initialised by listen_tcp whatever happens: close() closes it
  auto port = listen_tcp(loop_, &listener_, ep, 16, [](uv_stream_t* s, int status) {
    if (status == 0) static_cast<IdentityListener*>(s->data)->on_connection();
  });
  listener_.data = this;  // read by the callback, which runs from the loop only
  if (!port) return port.failure();
  port_ = *port;
  return {};
}

void IdentityListener::close() {
  // A connection that never sends its line would keep the loop, and so the agent, from ending.
  while (!clients_.empty()) (*clients_.begin())->close();
  if (!listening_) return;
  listening_ = false;
  uv_close(reinterpret_cast<uv_handle_t*>(&listener_), nullptr);
}

void IdentityListener::on_connection() {
  auto* c = new Client(this);
  uv_tcp_init(loop_, &c->tcp);
  c->tcp.data = c;
  clients_.insert(c);
  if (uv_accept(reinterpret_cast<uv_stream_t*>(&listener_), reinterpret_cast<uv_stream_t*>(&c->tcp)) != 0)
    return c->close();
  uv_read_start(
      reinterpret_cast<uv_stream_t*>(&c->tcp),
      [](uv_handle_t*, size_t suggested, uv_buf_t* buf) {
        buf->base = new char[suggested];
        buf->len = suggested;
      },
      [](uv_stream_t* s, ssize_t n, const uv_buf_t* buf) {
        std::unique_ptr<char[]> owned(buf->base);
        static_cast<Client*>(s->data)->on_read(n, buf->base);
      });
}

}  // namespace sg::agent
