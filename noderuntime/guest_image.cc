#include "noderuntime/guest_image.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <deque>
#include <filesystem>
#include <memory>

#include "common/fd.h"
#include "common/log.h"
#include "noderuntime/companion_files.h"
#include "noderuntime/uv_handles.h"

namespace sg {
namespace {

constexpr size_t kTailLines = 4;  // of the builder's output, quoted in a failure message
constexpr size_t kMaxLine = 4096;  // a longer "line" is logged in pieces (progress bars have no newline)

bool readable(const std::string& path) { return ::access(path.c_str(), R_OK) == 0; }

std::string parent_dir(const std::string& path) { return std::filesystem::path(path).parent_path().string(); }
std::string base_name(const std::string& path) { return std::filesystem::path(path).filename().string(); }

}  // namespace

GuestImageOptions guest_image_options(const NodeConfig& cfg) {
  GuestImageOptions o;
  o.kernel = cfg.guest_kernel_file();
  o.initrd = cfg.guest_initrd_file();
  o.autobuild = cfg.guest_image_autobuild;
  CompanionLookup builder = find_guest_image_builder(cfg.guest_image_builder);
  o.builder = builder.path;
  o.builder_tried = builder.tried_text();
  CompanionLookup agent = find_agent_binary(cfg.agent_path);
  o.agent = agent.path;
  o.agent_tried = agent.tried_text();
  return o;
}

// One run of the builder. Finished when the process has exited and its output reached EOF (the exit can be
// reported before the last lines are read, and those lines say why it failed).
struct GuestImage::Build {
  GuestImage* owner = nullptr;
  bool refresh = false;  // the image exists; a failure keeps it
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  uv_process_t* process = nullptr;
  uv_pipe_t* output = nullptr;
  uv_timer_t* deadline = nullptr;
  int pid = 0;
  bool exited = false;
  bool output_done = false;
  bool timed_out = false;
  int64_t exit_status = 0;
  int term_signal = 0;
  std::string partial;           // output after the last newline
  std::deque<std::string> tail;  // the last kTailLines lines

  ~Build() {
    // Only while it runs: a group id of an exited (reaped) process may be someone else's by now.
    if (pid > 0 && !exited) ::kill(-pid, SIGKILL);
    close_and_free(process);
    close_and_free(output);
    close_and_free(deadline);
  }
};

GuestImage::GuestImage(uv_loop_t* loop, GuestImageOptions options)
    : loop_(loop), options_(std::move(options)), dir_(parent_dir(options_.kernel)) {
  later_ = new uv_timer_t;
  uv_timer_init(loop_, later_);
  later_->data = this;
}

GuestImage::~GuestImage() {
  build_.reset();
  close_and_free(later_);
}

bool GuestImage::files_exist() const { return readable(options_.kernel) && readable(options_.initrd); }

std::string GuestImage::missing_file() const { return readable(options_.kernel) ? options_.initrd : options_.kernel; }

bool GuestImage::buildable() const {
  return options_.autobuild && base_name(options_.kernel) == "vmlinuz" && base_name(options_.initrd) == "initrd.img" &&
         parent_dir(options_.initrd) == dir_;
}

void GuestImage::ensure(Done done) {
  if (build_) {
    waiters_.push_back(std::move(done));
    return;
  }
  const bool exist = files_exist();
  if (exist && (checked_ || !buildable() || !readable(dir_ + "/.stamp"))) {
    checked_ = true;
    return settle_later(std::move(done), {});
  }
  const std::string by_hand = (options_.builder.empty() ? "deploy/build-guest-image.sh" : options_.builder) + " " +
                              (dir_.empty() ? "DIR" : dir_) + " " +
                              (options_.agent.empty() ? "<build>/agent/sandgate-agent" : options_.agent);
  if (!exist && !buildable()) {
    const char* why = options_.autobuild ? "node.guest_kernel and guest_initrd are not vmlinuz and initrd.img in "
                                           "one directory, so the node does not build them"
                                         : "node.guest_image_autobuild is off";
    return settle_later(std::move(done), fail(Error::kUnsupported, "guest image file " + missing_file() +
                                                                       " is missing (" + why + "); build it with " +
                                                                       by_hand));
  }
  if (options_.builder.empty()) {
    if (exist) {
      spdlog::warn("guest image: build-guest-image.sh not found (tried {}); using {} as it is", options_.builder_tried,
                   dir_);
      checked_ = true;
      return settle_later(std::move(done), {});
    }
    return settle_later(std::move(done),
                        fail(Error::kUnsupported, "guest image file " + missing_file() +
                                                      " is missing and the node cannot build it: build-guest-image.sh "
                                                      "not found (tried " + options_.builder_tried +
                                                      "); set node.guest_image_builder, or build it with " + by_hand));
  }
  waiters_.push_back(std::move(done));
  start_build(exist);
}

void GuestImage::start_build(bool refresh) {
  if (refresh) {
    spdlog::info("guest image: checking {} with {} (rebuilt only if its inputs changed)", dir_, options_.builder);
  } else {
    spdlog::info("guest image: preparing {} for the first QEMU sandbox with {}; the first time this downloads "
                 "Debian's cloud kernel (~27 MB), later builds reuse {}/.cache",
                 dir_, options_.builder, dir_);
  }
  if (options_.agent.empty())
    spdlog::warn("guest image: no sandgate-agent found (tried {}); the image gets none, so exec, files and health "
                 "will not work in QEMU sandboxes", options_.agent_tried);

  build_ = std::make_unique<Build>();
  Build& b = *build_;
  b.owner = this;
  b.refresh = refresh;
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);  // the script makes it too; this is for a clear error
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return settle(fail_errno("pipe", errno));
  UniqueFd read_end(fds[0]), write_end(fds[1]);

  std::vector<std::string> args = {options_.builder, dir_};
  if (!options_.agent.empty()) args.push_back(options_.agent);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  uv_stdio_container_t stdio[3];
  stdio[0].flags = UV_IGNORE;  // /dev/null: the script never asks
  stdio[1].flags = UV_INHERIT_FD;
  stdio[1].data.fd = write_end.get();
  stdio[2].flags = UV_INHERIT_FD;
  stdio[2].data.fd = write_end.get();
  uv_process_options_t po{};
  po.file = argv[0];
  po.args = argv.data();
  po.stdio = stdio;
  po.stdio_count = 3;
  // Its own process group (and session), so a timeout kills apt-get and dpkg-deb along with the script.
  po.flags = UV_PROCESS_DETACHED;
  po.exit_cb = [](uv_process_t* p, int64_t status, int signal) {
    auto* build = static_cast<Build*>(p->data);
    if (build == nullptr) return;
    build->exited = true;
    build->exit_status = status;
    build->term_signal = signal;
    uv_timer_stop(build->deadline);
    build->owner->maybe_finish();
  };
  b.process = new uv_process_t;
  b.process->data = &b;
  if (int rc = uv_spawn(loop_, b.process, &po); rc != 0) {
    // A handle whose spawn failed still has to be closed.
    return settle(fail(Error::kUnavailable, "cannot run the guest image builder " + options_.builder + ": " +
                                                uv_strerror(rc)));
  }
  b.pid = b.process->pid;
  write_end.reset();  // the child's copy stays open; EOF comes once it (and its children) are done

  b.output = new uv_pipe_t;
  uv_pipe_init(loop_, b.output, 0);
  b.output->data = &b;
  uv_pipe_open(b.output, read_end.release());
  uv_read_start(
      reinterpret_cast<uv_stream_t*>(b.output),
      [](uv_handle_t*, size_t suggested, uv_buf_t* buf) {
        buf->base = new char[suggested];
        buf->len = suggested;
      },
      [](uv_stream_t* s, ssize_t n, const uv_buf_t* buf) {
        std::unique_ptr<char[]> owned(buf->base);
        auto* build = static_cast<Build*>(s->data);
        if (build == nullptr) return;
        if (n > 0) return build->owner->on_output(std::string_view(buf->base, static_cast<size_t>(n)));
        if (n == 0) return;  // EAGAIN
        build->owner->on_output("\n");  // flushes a last line without a newline
        build->output_done = true;
        close_and_free(build->output);
        build->owner->maybe_finish();
      });

  b.deadline = new uv_timer_t;
  uv_timer_init(loop_, b.deadline);
  b.deadline->data = &b;
  uv_timer_start(
      b.deadline,
      [](uv_timer_t* t) {
        auto* build = static_cast<Build*>(t->data);
        if (build == nullptr) return;
        build->timed_out = true;
        ::kill(-build->pid, SIGKILL);  // the exit callback and EOF follow
      },
      options_.timeout_ms, 0);
}

void GuestImage::on_output(std::string_view chunk) {
  Build& b = *build_;
  for (char c : chunk) {
    if (c != '\n' && c != '\r' && b.partial.size() < kMaxLine) {
      b.partial += c;
      continue;
    }
    if (c != '\n' && c != '\r') b.partial += c;
    if (b.partial.empty()) continue;
    spdlog::info("guest image: {}", b.partial);
    b.tail.push_back(std::move(b.partial));
    if (b.tail.size() > kTailLines) b.tail.pop_front();
    b.partial.clear();
  }
}

void GuestImage::maybe_finish() {
  if (!build_->exited || !build_->output_done) return;
  settle(build_result());
}

Status GuestImage::build_result() const {
  const Build& b = *build_;
  std::string said;
  for (const std::string& line : b.tail) said += (said.empty() ? "" : " / ") + line;
  const std::string by_hand = options_.builder + " " + dir_ + (options_.agent.empty() ? "" : " " + options_.agent);
  const std::string next = "; fix that and create the sandbox again (the node retries the build), or run " +
                           by_hand + " by hand";
  const std::string where = "cannot prepare the guest image in " + dir_ + ": ";
  if (b.timed_out)
    return fail(Error::kTimeout, where + "the builder did not finish within " +
                                     std::to_string(options_.timeout_ms / 1000) + " s (last output: " + said + ")" +
                                     next);
  if (b.term_signal != 0)
    return fail(Error::kUnavailable, where + "the builder was killed by signal " + std::to_string(b.term_signal) + next);
  if (b.exit_status == kGuestImageNoKernelPackage)
    return fail(Error::kUnavailable, where + "Debian's cloud kernel package cannot be resolved or downloaded (" +
                                         said + "); the first build needs the Debian mirrors (apt-get download)" +
                                         next);
  if (b.exit_status != 0)
    return fail(Error::kUnavailable,
                where + "the builder exited with status " + std::to_string(b.exit_status) + " (" + said + ")" + next);
  if (!files_exist())
    return fail(Error::kInternal, where + "the builder succeeded but " + missing_file() + " is not there");
  return {};
}

void GuestImage::settle(Status s) {
  const bool refresh = build_->refresh;
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - build_->started).count();
  build_.reset();
  if (s) {
    spdlog::info("guest image: {} ready ({:.1f} s)", dir_, secs);
    checked_ = true;
  } else if (refresh && files_exist()) {
    // The image that is there booted before; a failed check must not take QEMU sandboxes away.
    spdlog::warn("guest image: {}; using the existing image", s.message());
    checked_ = true;
    s = {};
  } else {
    spdlog::error("guest image: {}", s.message());
  }
  std::vector<Done> waiters = std::move(waiters_);
  waiters_.clear();
  // Through later_ like every result, so that none is delivered inside the ensure() that started the build.
  for (Done& d : waiters) settle_later(std::move(d), s);
}

void GuestImage::settle_later(Done done, Status s) {
  later_queue_.emplace_back(std::move(done), std::move(s));
  uv_timer_start(
      later_,
      [](uv_timer_t* t) {
        auto* self = static_cast<GuestImage*>(t->data);
        auto queue = std::move(self->later_queue_);
        self->later_queue_.clear();
        for (auto& [d, s] : queue) d(std::move(s));
      },
      0, 0);
}

}  // namespace sg
