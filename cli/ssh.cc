#include "cli/ssh.h"

#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "cli/commands.h"
#include "cli/settings.h"
#include "common/fd.h"
#include "noderuntime/names.h"

namespace sg::cli {
namespace {

constexpr size_t kMaxTokenFileBytes = 4096;
constexpr size_t kMaxConnectAnswerHead = 16 * 1024;
constexpr size_t kMaxRefusalBody = 64 * 1024;
constexpr int kRefusalBodyTimeoutMs = 5'000;
constexpr size_t kRelayBufferBytes = 64 * 1024;
constexpr size_t kMaxUserName = 32;
constexpr size_t kMaxDomain = 253;

bool has_control_char(std::string_view s) {
  return std::any_of(s.begin(), s.end(), [](unsigned char c) { return c < 0x20 || c == 0x7f; });
}

// The value of Content-Length in an answer head, if it has a well-formed one.
std::optional<size_t> content_length(std::string_view head) {
  size_t pos = 0;
  while ((pos = head.find("\r\n", pos)) != std::string_view::npos) {
    pos += 2;
    std::string_view line = head.substr(pos, head.find("\r\n", pos) - pos);
    constexpr std::string_view kName = "content-length:";
    if (line.size() <= kName.size()) continue;
    std::string lower(line.substr(0, kName.size()));
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
    if (lower != kName) continue;
    std::string value(trim(line.substr(kName.size())));
    size_t n = 0;
    auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), n);
    if (ec == std::errc() && end == value.data() + value.size()) return n;
  }
  return std::nullopt;
}

bool set_nonblocking(int fd) {
  int flags = ::fcntl(fd, F_GETFL);
  return flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0;
}

// The relay after a successful CONNECT. TLS has no half-close, so stdin's EOF becomes close_notify (the proxy
// turns it into shutdown(SHUT_WR) toward the sandbox) and reading goes on until the server ends the stream;
// that is what lets scp/rsync receive their last bytes after they finished sending.
int relay(SSL* ssl, int sock, int in_fd, int out_fd, std::string down) {
  auto failed = [](const std::string& m) {
    std::fprintf(stderr, "sandgate ssh-proxy: %s\n", m.c_str());
    return 1;
  };
  if (!set_nonblocking(in_fd) || !set_nonblocking(out_fd))
    return failed(std::string("cannot make stdin/stdout non-blocking: ") + std::strerror(errno));
  std::string up;
  size_t up_off = 0, down_off = 0;
  size_t retry_len = 0;  // an SSL_write that wanted I/O must be repeated with the same length
  bool in_eof = false, tls_eof = false, shutdown_sent = false;
  std::unique_ptr<char[]> buf = std::make_unique<char[]>(kRelayBufferBytes);
  for (;;) {
    bool sock_in = false, sock_out = false;
    // Any step that moved something may have unblocked another (a drained stdout lets the tunnel be read):
    // poll only after a round in which nothing moved, or it would sleep with work to do.
    bool progressed = false;
    // stdin -> up
    if (!in_eof && up_off == up.size()) {
      ssize_t n = ::read(in_fd, buf.get(), kRelayBufferBytes);
      if (n > 0) {
        up.assign(buf.get(), static_cast<size_t>(n));
        up_off = 0;
        progressed = true;
      } else if (n == 0) {
        in_eof = true;
        progressed = true;
      } else if (errno != EAGAIN && errno != EINTR) {
        return failed(std::string("read stdin: ") + std::strerror(errno));
      }
    }
    // up -> TLS
    if (up_off < up.size()) {
      size_t len = retry_len != 0 ? retry_len : up.size() - up_off;
      size_t sent = 0;
      int ret = SSL_write_ex(ssl, up.data() + up_off, len, &sent);
      if (ret == 1) {
        up_off += sent;
        retry_len = 0;
        progressed = true;
      } else {
        int err = SSL_get_error(ssl, ret);
        if (err == SSL_ERROR_WANT_READ) {
          sock_in = true;
        } else if (err == SSL_ERROR_WANT_WRITE) {
          sock_out = true;
        } else if (tls_eof) {
          up_off = up.size();  // the server is gone; what is left has nowhere to go
        } else {
          return failed("sending to the ingress: " + openssl_errors());
        }
        retry_len = sock_in || sock_out ? len : 0;
      }
    }
    // stdin finished and everything is sent: close_notify, once
    if (in_eof && up_off == up.size() && !shutdown_sent && !tls_eof) {
      int ret = SSL_shutdown(ssl);
      if (ret >= 0) {
        shutdown_sent = true;
        progressed = true;
      } else if (SSL_get_error(ssl, ret) == SSL_ERROR_WANT_WRITE) {
        sock_out = true;
      } else {
        shutdown_sent = true;  // cannot send it: reading on still tells how the server ends
      }
    }
    // TLS -> down (only into an empty buffer: stdout's pace limits how fast the tunnel is read)
    if (!tls_eof && down_off == down.size()) {
      size_t got = 0;
      int ret = SSL_read_ex(ssl, buf.get(), kRelayBufferBytes, &got);
      if (ret == 1) {
        down.assign(buf.get(), got);
        down_off = 0;
        progressed = true;
      } else {
        int err = SSL_get_error(ssl, ret);
        if (err == SSL_ERROR_WANT_READ) {
          sock_in = true;
        } else if (err == SSL_ERROR_WANT_WRITE) {
          sock_out = true;
        } else if (err == SSL_ERROR_ZERO_RETURN || (err == SSL_ERROR_SYSCALL && ERR_peek_error() == 0)) {
          tls_eof = true;
        } else {
          return failed("reading from the ingress: " + openssl_errors());
        }
      }
    }
    // down -> stdout
    if (down_off < down.size()) {
      ssize_t n = ::write(out_fd, down.data() + down_off, down.size() - down_off);
      if (n > 0) {
        down_off += static_cast<size_t>(n);
        progressed = true;
      } else if (n < 0 && errno == EPIPE) {
        return 0;  // ssh closed its end: nobody is left to read
      } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
        return failed(std::string("write stdout: ") + std::strerror(errno));
      }
    }
    if (tls_eof && down_off == down.size()) return 0;
    if (progressed) continue;

    // Bytes OpenSSL already holds produce no poll event: go round again instead of sleeping on them.
    bool ready = down_off == down.size() && !tls_eof && SSL_has_pending(ssl);
    short sock_events = static_cast<short>((sock_in ? POLLIN : 0) | (sock_out ? POLLOUT : 0));
    pollfd fds[3];
    nfds_t count = 0;
    // A negative fd is skipped: a hung-up socket nobody wants to read yet must not make poll spin.
    fds[count++] = {sock_events != 0 ? sock : -1, sock_events, 0};
    if (!in_eof && up_off == up.size()) fds[count++] = {in_fd, POLLIN, 0};
    if (down_off < down.size()) fds[count++] = {out_fd, POLLOUT, 0};
    if (::poll(fds, count, ready ? 0 : -1) < 0 && errno != EINTR)
      return failed(std::string("poll: ") + std::strerror(errno));
  }
}

}  // namespace

Status validate_ref(std::string_view ref) {
  if (looks_like_id(ref)) return {};
  if (auto s = validate_name(ref); !s)
    return fail(Error::kInvalidArgument, "'" + std::string(ref) + "' is not a sandbox name or id: " + s.message());
  return {};
}

Status validate_domain(std::string_view domain) {
  auto bad = [&](std::string_view why) {
    return fail(Error::kInvalidArgument, "invalid domain '" + std::string(domain) + "': " + std::string(why));
  };
  if (domain.empty() || domain.size() > kMaxDomain) return bad("must be 1-253 characters");
  size_t start = 0;
  while (start <= domain.size()) {
    size_t dot = domain.find('.', start);
    std::string_view label = domain.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start);
    if (label.empty() || label.size() > 63) return bad("every label must be 1-63 characters");
    if (label.front() == '-' || label.back() == '-') return bad("a label must not start or end with '-'");
    for (char c : label)
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-') return bad("only letters, digits, '-' and '.'");
    if (dot == std::string_view::npos) break;
    start = dot + 1;
  }
  return {};
}

Result<SshHost> parse_ssh_host(std::string_view host, std::string_view default_domain) {
  SshHost out;
  size_t dot = host.find('.');
  out.name = std::string(host.substr(0, dot));
  out.domain = dot == std::string_view::npos ? std::string(default_domain) : std::string(host.substr(dot + 1));
  if (auto s = validate_ref(out.name); !s) return s.failure();
  if (auto s = validate_domain(out.domain); !s) return s.failure();
  return out;
}

Result<std::string> ssh_config_block(const SshConfigOptions& opts) {
  if (auto s = validate_ref(opts.name); !s) return s.failure();
  if (auto s = validate_domain(opts.domain); !s) return s.failure();
  if (auto s = parse_ingress(opts.ingress); !s) return s.failure();
  bool user_ok = !opts.user.empty() && opts.user.size() <= kMaxUserName && opts.user.front() != '-' &&
                 std::all_of(opts.user.begin(), opts.user.end(), [](unsigned char c) {
                   return std::isalnum(c) || c == '_' || c == '-' || c == '.';
                 });
  if (!user_ok)
    return fail(Error::kInvalidArgument, "invalid --user '" + opts.user +
                                             "': 1-32 of letters, digits, '_', '-', '.', not starting with '-'");
  if (opts.exe_path.empty() || opts.exe_path.front() != '/' || has_control_char(opts.exe_path))
    return fail(Error::kInvalidArgument, "cannot name this program's path in ssh_config: '" + opts.exe_path + "'");
  if (has_control_char(opts.cacert))
    return fail(Error::kInvalidArgument, "--cacert must not contain control characters");
  std::vector<std::string> args = {opts.exe_path, "ssh-proxy", "--ingress", opts.ingress};
  if (!opts.cacert.empty()) args.insert(args.end(), {"--cacert", opts.cacert});
  // ssh expands %-tokens in ProxyCommand before the shell sees it; %h (the HostName below) is the only one
  // meant here, so a literal '%' in a path is doubled.
  std::string command;
  for (char c : shell_join(args)) command += c == '%' ? std::string("%%") : std::string(1, c);
  return "Host " + opts.name + "\n" +
         "  HostName " + opts.name + "." + opts.domain + "\n" +
         "  User " + opts.user + "\n" +
         "  ProxyCommand " + command + " %h\n" +
         "  ServerAliveInterval 30\n"
         "  ServerAliveCountMax 3\n";
}

Result<std::string> default_config_home() {
  if (const char* xdg = std::getenv("XDG_CONFIG_HOME"); xdg != nullptr && xdg[0] == '/') return std::string(xdg);
  if (const char* home = std::getenv("HOME"); home != nullptr && home[0] == '/') return std::string(home) + "/.config";
  if (passwd* pw = ::getpwuid(::getuid()); pw != nullptr && pw->pw_dir != nullptr && pw->pw_dir[0] == '/')
    return std::string(pw->pw_dir) + "/.config";
  return fail(Error::kNotFound, "cannot tell where the home directory is (HOME is not set)");
}

std::string token_file(const std::string& config_home, std::string_view ref) {
  return config_home + "/sandgate/tokens/" + std::string(ref);
}

Status save_token(const std::string& config_home, std::string_view ref, std::string_view token) {
  if (auto s = validate_ref(ref); !s) return s;
  // Only our own directories are forced to 0700; config_home itself is the user's and only created if missing.
  std::string dirs[] = {config_home, config_home + "/sandgate", config_home + "/sandgate/tokens"};
  for (size_t i = 0; i < 3; ++i) {
    if (::mkdir(dirs[i].c_str(), 0700) != 0 && errno != EEXIST) return fail_errno("mkdir " + dirs[i], errno);
    if (i > 0 && ::chmod(dirs[i].c_str(), 0700) != 0) return fail_errno("chmod " + dirs[i], errno);
  }
  std::string path = token_file(config_home, ref);
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  ::unlink(tmp.c_str());
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!fd.valid()) return fail_errno("create " + tmp, errno);
  std::string text = std::string(token) + "\n";
  bool ok = ::fchmod(fd.get(), 0600) == 0 && ::write(fd.get(), text.data(), text.size()) == static_cast<ssize_t>(text.size()) &&
            ::fsync(fd.get()) == 0;
  int err = errno;
  fd.reset();
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    if (ok) err = errno;
    ::unlink(tmp.c_str());
    return fail_errno("write " + path, err);
  }
  return {};
}

Result<std::string> load_token(const std::string& config_home, std::string_view ref) {
  if (auto s = validate_ref(ref); !s) return s.failure();
  std::string path = token_file(config_home, ref);
  auto text = read_small_file(path, kMaxTokenFileBytes);
  if (!text) {
    if (text.error() == Error::kNotFound)
      return fail(Error::kNotFound, "no token saved for " + std::string(ref) + " at " + path);
    return text.failure();
  }
  std::string token(trim(*text));
  if (token.empty()) return fail(Error::kNotFound, path + " holds no token");
  if (!token_fits_header(token))
    return fail(Error::kInvalidArgument, path + " does not hold a token (one line, no spaces)");
  return token;
}

Status remove_token(const std::string& config_home, std::string_view ref) {
  if (auto s = validate_ref(ref); !s) return s;
  std::string path = token_file(config_home, ref);
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return fail_errno("remove " + path, errno);
  return {};
}

std::string connect_refusal_hint(int status, const SshProxyOptions& opts) {
  const std::string& name = opts.name;
  const std::string port = std::to_string(opts.port);
  switch (status) {
    case 401:
      return "pass " + name + "'s own token with --token or SANDGATE_TOKEN (the one `sandgate create` printed); "
             "a token saved for an earlier sandbox of that name no longer works";
    case 403:
      return "port " + port + " is not open to tunnels: connect to a port " + name +
             " exposes (--port; `sandgate get " + name + "` lists them), or create it with --expose " + port +
             "/tcp";
    case 404:
      return "`sandgate ls` lists the sandboxes; is " + opts.domain + " (--domain) served by this ingress?";
    case 502:
      return "nothing in " + name + " accepted the connection on port " + port +
             ": is its sshd (or whatever should listen there) running? `sandgate get " + name + "` shows the sandbox";
    case 503:
      return "`sandgate get " + name + "` shows its state; a failed sandbox must be removed (`sandgate rm " + name +
             "`) and created again";
    default:
      return "";
  }
}

std::string tunnel_host(const SshProxyOptions& opts) {
  return std::to_string(opts.port) + "-" + opts.name + "." + opts.domain;
}

std::string connect_request(const SshProxyOptions& opts) {
  return "CONNECT " + opts.name + ":" + std::to_string(opts.port) + " HTTP/1.1\r\nHost: " + tunnel_host(opts) +
         "\r\nAuthorization: Bearer " + opts.token + "\r\n\r\n";
}

int run_ssh_proxy(const SshProxyOptions& opts, int in_fd, int out_fd) {
  auto failed = [](const std::string& m) {
    std::fprintf(stderr, "sandgate ssh-proxy: %s\n", m.c_str());
    return 1;
  };
  if (!token_fits_header(opts.token))
    return failed("the token is empty or malformed");
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(opts.connect_timeout_ms);
  const std::string sni = tunnel_host(opts);

  std::string dial_hint = "pass --ingress HOST:PORT or set SANDGATE_INGRESS (this address came from " +
                          (opts.ingress_from.empty() ? std::string("the built-in default") : opts.ingress_from) + ")";
  auto conn = tls_connect(TlsClientOptions{opts.ingress, sni, opts.cacert, std::move(dial_hint)}, deadline);
  if (!conn) return failed(conn.message());
  SSL* ssl = conn->ssl.get();
  const int sock = conn->sock.get();
  if (auto s = ssl_write_all(ssl, sock, connect_request(opts), deadline, "sending CONNECT"); !s)
    return failed(s.message());

  // The answer's head; whatever follows it already belongs to the tunnel (or, on a refusal, to its body).
  std::string answer;
  size_t head_end = std::string::npos;
  char buf[4096];
  while ((head_end = answer.find("\r\n\r\n")) == std::string::npos) {
    if (answer.size() > kMaxConnectAnswerHead) return failed("the ingress's answer to CONNECT is too large");
    auto n = ssl_read_some(ssl, sock, buf, sizeof buf, deadline, "waiting for the CONNECT answer");
    if (!n) return failed(n.message());
    if (*n == 0) return failed("the ingress closed the connection without answering CONNECT");
    answer.append(buf, *n);
  }
  std::string head = answer.substr(0, head_end + 2);
  std::string rest = answer.substr(head_end + 4);
  std::string status_line = head.substr(0, head.find("\r\n"));
  bool ok = status_line.size() >= 12 && status_line.starts_with("HTTP/1.") && status_line.compare(8, 4, " 200") == 0 &&
            (status_line.size() == 12 || status_line[12] == ' ');
  if (!ok) {
    std::optional<size_t> length = content_length(head);
    const Clock::time_point body_deadline = Clock::now() + std::chrono::milliseconds(kRefusalBodyTimeoutMs);
    while (rest.size() < std::min(length.value_or(kMaxRefusalBody), kMaxRefusalBody)) {
      auto n = ssl_read_some(ssl, sock, buf, sizeof buf, body_deadline, "reading the refusal");
      if (!n || *n == 0) break;
      rest.append(buf, *n);
    }
    if (rest.size() > kMaxRefusalBody) rest.resize(kMaxRefusalBody);
    std::fprintf(stderr, "sandgate ssh-proxy: the ingress refused CONNECT to %s: %s\n", sni.c_str(),
                 status_line.c_str());
    if (!rest.empty()) std::fprintf(stderr, "%s%s", rest.c_str(), rest.back() == '\n' ? "" : "\n");
    int status = 0;  // stays 0 (no hint) for a status line too short to hold one
    if (status_line.size() >= 12) std::from_chars(status_line.data() + 9, status_line.data() + 12, status);
    if (std::string hint = connect_refusal_hint(status, opts); !hint.empty())
      std::fprintf(stderr, "sandgate ssh-proxy: %s\n", hint.c_str());
    return 1;
  }
  return relay(ssl, sock, in_fd, out_fd, std::move(rest));
}

}  // namespace sg::cli
