#include "common/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>

#include "common/fd.h"

extern char** environ;

namespace sg {
namespace {

long now_ms() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000 + ts.tv_nsec / 1'000'000;
}

std::string command_line(const std::vector<std::string>& argv) {
  std::string out;
  for (const std::string& a : argv) out += (out.empty() ? "" : " ") + a;
  return out;
}

std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

}  // namespace

Result<std::string> run_tool(const std::vector<std::string>& argv, std::string_view input, int timeout_ms) {
  if (argv.empty()) return fail(Error::kInvalidArgument, "run_tool: empty command");
  int in[2], out[2], err[2];
  // stdin is a socket, not a pipe: a tool that exits without reading it must not kill the caller with
  // SIGPIPE, and send(MSG_NOSIGNAL) exists for sockets only.
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, in) != 0) return fail_errno("socketpair", errno);
  UniqueFd in_r(in[0]), in_w(in[1]);
  if (::pipe2(out, O_CLOEXEC) != 0) return fail_errno("pipe", errno);
  UniqueFd out_r(out[0]), out_w(out[1]);
  if (::pipe2(err, O_CLOEXEC) != 0) return fail_errno("pipe", errno);
  UniqueFd err_r(err[0]), err_w(err[1]);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in_r.get(), STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, out_w.get(), STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, err_w.get(), STDERR_FILENO);
  // Only stdio goes to the tool, not whatever else this process holds without O_CLOEXEC.
  posix_spawn_file_actions_addclosefrom_np(&actions, 3);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = ::posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) return fail_errno("run " + argv[0], spawned);
  in_r.reset();
  out_w.reset();
  err_w.reset();

  // Feed stdin and drain both outputs together, so a tool that writes a lot before reading all of its input
  // cannot deadlock against us.
  std::string stdout_text, stderr_text;
  size_t input_sent = 0;
  if (input.empty()) in_w.reset();
  else ::fcntl(in_w.get(), F_SETFL, O_NONBLOCK);
  const long deadline = now_ms() + timeout_ms;
  bool timed_out = false;
  while (out_r.valid() || err_r.valid()) {
    pollfd fds[3];
    int n = 0;
    if (out_r.valid()) fds[n++] = {out_r.get(), POLLIN, 0};
    if (err_r.valid()) fds[n++] = {err_r.get(), POLLIN, 0};
    if (in_w.valid()) fds[n++] = {in_w.get(), POLLOUT, 0};
    const long left = deadline - now_ms();
    if (left <= 0) {
      timed_out = true;
      break;
    }
    const int ready = ::poll(fds, static_cast<nfds_t>(n), static_cast<int>(left));
    if (ready < 0 && errno != EINTR) break;
    for (int i = 0; i < n; ++i) {
      if (fds[i].revents == 0) continue;
      if (in_w.valid() && fds[i].fd == in_w.get()) {
        ssize_t w = ::send(in_w.get(), input.data() + input_sent, input.size() - input_sent, MSG_NOSIGNAL);
        if (w > 0) input_sent += static_cast<size_t>(w);
        if ((w < 0 && errno != EAGAIN) || input_sent == input.size()) in_w.reset();
        continue;
      }
      UniqueFd& fd = fds[i].fd == out_r.get() ? out_r : err_r;
      std::string& text = fds[i].fd == out_r.get() ? stdout_text : stderr_text;
      char buf[4096];
      ssize_t r = ::read(fd.get(), buf, sizeof buf);
      if (r <= 0) {
        if (r == 0 || errno != EINTR) fd.reset();
        continue;
      }
      if (text.size() < kMaxToolOutputBytes) text.append(buf, static_cast<size_t>(r));
    }
  }
  if (timed_out) ::kill(pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  const std::string what = command_line(argv);
  if (timed_out) return fail(Error::kTimeout, what + ": killed after " + std::to_string(timeout_ms) + " ms");
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return stdout_text;
  std::string why = WIFEXITED(status) ? "exit status " + std::to_string(WEXITSTATUS(status))
                                      : "killed by signal " + std::to_string(WTERMSIG(status));
  stderr_text = trimmed(std::move(stderr_text));
  return fail(Error::kUnavailable, what + ": " + why + (stderr_text.empty() ? "" : ": " + stderr_text));
}

}  // namespace sg
