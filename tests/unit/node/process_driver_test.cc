// The process driver against the real kernel (as root): real sandgate-init, real namespaces, real cgroups.
// Every test gets its own cgroup parent and state dir, and TearDown kills and removes whatever a failing
// test left behind.
#include "noderuntime/process_driver.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include "noderuntime/cgroup.h"
#include "snapshot/image_store.h"
#include "tests/netns.h"
#include "tests/unit/temp_dir.h"

namespace sg {
namespace {

using namespace std::chrono_literals;

constexpr uint16_t kHttpPort = 8080;

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

template <typename Pred>
bool wait_for(Pred pred, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

// Fields of /proc/<pid>/stat after the comm, numbered as in proc(5) (3 = state, 4 = ppid, 6 = session).
std::string stat_field(int pid, int field) {
  std::string stat = slurp("/proc/" + std::to_string(pid) + "/stat");
  if (stat.empty()) return {};
  std::istringstream rest(stat.substr(stat.rfind(')') + 2));
  std::string value;
  for (int i = 3; i <= field && rest >> value; ++i) {
  }
  return value;
}

std::string ns_of(const std::string& pid, const char* ns) {
  std::error_code ec;
  return std::filesystem::read_symlink("/proc/" + pid + "/ns/" + ns, ec).string();
}

std::vector<int> pids_in(const std::string& cgroup_dir) {
  std::vector<int> pids;
  std::istringstream in(slurp(cgroup_dir + "/cgroup.procs"));
  int pid;
  while (in >> pid) pids.push_back(pid);
  return pids;
}

// One HTTP/1.0 GET through a socket of the sandbox's network namespace, connected to its 127.0.0.1:<port>.
Result<std::string> http_get_once(UniqueFd sock, const std::string& path, uint16_t port = kHttpPort) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 && errno != EINPROGRESS)
    return fail_errno("connect", errno);
  pollfd pfd{sock.get(), POLLOUT, 0};
  if (::poll(&pfd, 1, 2000) != 1) return fail(Error::kTimeout, "connect timed out");
  int err = 0;
  socklen_t len = sizeof err;
  ::getsockopt(sock.get(), SOL_SOCKET, SO_ERROR, &err, &len);
  if (err != 0) return fail_errno("connect", err);
  const std::string request = "GET " + path + " HTTP/1.0\r\nHost: sandbox\r\n\r\n";
  if (::send(sock.get(), request.data(), request.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(request.size()))
    return fail_errno("send", errno);
  std::string response;
  for (;;) {
    pfd = {sock.get(), POLLIN, 0};
    if (::poll(&pfd, 1, 5000) != 1) return fail(Error::kTimeout, "response timed out");
    char buf[4096];
    ssize_t n = ::recv(sock.get(), buf, sizeof buf, 0);
    if (n < 0) return fail_errno("recv", errno);
    if (n == 0) return response;
    response.append(buf, static_cast<size_t>(n));
  }
}

// A sandbox sees only its image. This one is tiny and made from the host's busybox-static (Debian package
// busybox-static): /bin/busybox and a link per applet (sh, sleep, httpd, ...), as a one-layer `docker save`
// archive, made once per test process in a temp dir of its own. Empty when it cannot be made.
const std::string& busybox_archive() {
  static const testing::TempDir dir("sgtest-busybox");
  static const std::string archive = [] {
    const std::string root = dir.path() + "/root";
    const std::string script =
        "mkdir -p " + root + "/bin " + root + "/proc " + root + "/sys " + root + "/dev " + root + "/tmp " +
        root + "/etc " + dir.path() + "/out/l0; cp /bin/busybox " + root + "/bin/busybox; "
        "for a in $(/bin/busybox --list); do [ \"$a\" = busybox ] || ln -s busybox " + root + "/bin/$a; done; "
        "tar -cf " + dir.path() + "/out/l0/layer.tar -C " + root + " .; "
        "d=$(sha256sum " + dir.path() + "/out/l0/layer.tar | cut -d' ' -f1); "
        "echo '{\"os\":\"linux\",\"rootfs\":{\"type\":\"layers\",\"diff_ids\":[\"sha256:'$d'\"]}}' > " +
        dir.path() + "/out/config.json; "
        "echo '[{\"Config\":\"config.json\",\"Layers\":[\"l0/layer.tar\"]}]' > " + dir.path() +
        "/out/manifest.json; tar -cf " + dir.path() + "/busybox.tar -C " + dir.path() + "/out .";
    const std::string script_path = dir.path() + "/make-busybox-image.sh";
    std::ofstream(script_path) << script << "\n";
    return std::system(("sh -e " + script_path).c_str()) == 0 ? dir.path() + "/busybox.tar" : std::string();
  }();
  return archive;
}

// The busybox image, imported as "busybox" into a store in `dir`.
Result<std::unique_ptr<snapshot::ImageStore>> make_busybox_image(const std::string& dir) {
  if (busybox_archive().empty()) return fail(Error::kIo, "cannot make the busybox image (is busybox-static installed?)");
  auto store = snapshot::ImageStore::open(dir + "/images");
  if (!store) return store.failure();
  auto imported = (*store)->import(busybox_archive(), "busybox");
  if (!imported) return imported.failure();
  return store;
}

class ProcessDriverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(uv_loop_init(&loop_), 0);
    loop_initialized_ = true;
    char tmpl[] = "/tmp/sgtest-driver-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    state_dir_ = tmpl;
    static int counter = 0;
    cfg_.state_dir = state_dir_;
    cfg_.cgroup_name = "sgtest-" + std::to_string(::getpid()) + "-" + std::to_string(++counter);
    cfg_.init_path = SANDGATE_BIN_DIR "/noderuntime/sandgate-init";
    cfg_.suspend_timeout_ms = 5'000;
    auto detection = detect_cgroups();
    ASSERT_TRUE(detection.ok()) << detection.message();
    cgroups_.emplace(*detection, cfg_.cgroup_name);
    auto images = make_busybox_image(state_dir_);
    ASSERT_TRUE(images.ok()) << images.message();
    images_ = std::move(*images);
    auto driver = make_process_driver(&loop_, cfg_, images_.get());
    ASSERT_TRUE(driver.ok()) << driver.message();
    driver_ = std::move(*driver);
  }

  void TearDown() override {
    for (const auto& [spec, info] : started_) {
      if (driver_) {
        Status terminated = terminate(spec, info);
        EXPECT_TRUE(terminated.ok()) << spec.id << ": " << terminated.message();
      }
      // Belt and braces for a driver bug: nothing of this test may outlive it.
      SandboxCgroup cg = cgroups_->sandbox(spec.id);
      (void)cg.kill_all();
      (void)cg.remove();
      ::kill(info.pid, SIGKILL);
      ::waitpid(info.pid, nullptr, WNOHANG);
    }
    if (cgroups_) {
      for (const auto& dir : cgroups_->parent_dirs()) {
        if (::rmdir(dir.c_str()) != 0) {
          EXPECT_EQ(errno, ENOENT) << dir;
        }
      }
    }
    driver_.reset();
    if (loop_initialized_) {
      // The driver must have closed every handle it opened: a leak keeps the loop busy forever.
      int rc = UV_EBUSY;
      for (int i = 0; i < 100 && (rc = uv_loop_close(&loop_)) == UV_EBUSY; ++i) uv_run(&loop_, UV_RUN_NOWAIT);
      EXPECT_EQ(rc, 0) << "handles left open on the loop";
    }
    if (!state_dir_.empty()) std::filesystem::remove_all(state_dir_);
  }

  SandboxSpec make_spec(std::vector<std::string> command, const std::string& name = "") {
    static int counter = 0;
    char id[32];
    std::snprintf(id, sizeof id, "sb-test%05d", ++counter);
    SandboxSpec spec;
    spec.id = id;
    spec.name = name;
    spec.command = std::move(command);
    spec.cwd = "/";
    spec.cpus = 1.0;
    spec.memory_mb = 256;
    spec.image = "busybox";
    spec.uid_base = 0x10000000 + static_cast<uint32_t>(counter) * kUidRangeSize;
    return spec;
  }

  Result<RuntimeInfo> start(const SandboxSpec& spec) { return start_with(*driver_, spec); }

  // Starts through `driver` and waits for the answer, which must not arrive before start() returns.
  Result<RuntimeInfo> start_with(Driver& driver, const SandboxSpec& spec) {
    auto result = std::make_shared<std::optional<Result<RuntimeInfo>>>();
    driver.start(spec, sandbox_dir(spec), [result](Result<RuntimeInfo> r) { result->emplace(std::move(r)); });
    if (result->has_value()) return fail(Error::kInternal, "callback ran before the call returned");
    if (!run_until([&] { return result->has_value(); })) return fail(Error::kTimeout, "start never answered");
    if ((*result)->ok()) started_.emplace_back(spec, ***result);
    return std::move(**result);
  }

  // By value: SandboxCgroup::dirs() returns a reference into the cgroup, which must not be a temporary.
  std::vector<std::string> cgroup_dirs(const SandboxSpec& spec) const { return cgroups_->sandbox(spec.id).dirs(); }
  std::string sandbox_dir(const SandboxSpec& spec) const { return state_dir_ + "/sandboxes/" + spec.id; }
  std::string log_of(const SandboxSpec& spec) const { return slurp(sandbox_dir(spec) + "/output.log"); }

  // Runs the loop until `done` or the deadline; false on deadline, so a driver bug fails instead of hanging.
  bool run_until(const std::function<bool()>& done, std::chrono::milliseconds timeout = 10s) {
    struct Deadline {
      uv_timer_t timer;
      bool expired = false;
      bool closed = false;
    } deadline;
    uv_update_time(&loop_);  // the test may have blocked for a while since the loop last ran
    uv_timer_init(&loop_, &deadline.timer);
    deadline.timer.data = &deadline;
    uv_timer_start(&deadline.timer, [](uv_timer_t* t) { static_cast<Deadline*>(t->data)->expired = true; },
                   static_cast<uint64_t>(timeout.count()), 0);
    while (!done() && !deadline.expired) uv_run(&loop_, UV_RUN_ONCE);
    uv_close(reinterpret_cast<uv_handle_t*>(&deadline.timer),
             [](uv_handle_t* h) { static_cast<Deadline*>(h->data)->closed = true; });
    while (!deadline.closed) uv_run(&loop_, UV_RUN_NOWAIT);
    return done();
  }

  // Starts an asynchronous driver call and waits for its callback, which must not run before the call returns.
  Status await(const std::function<void(Driver::Done)>& call) {
    auto result = std::make_shared<std::optional<Status>>();
    call([result](Status s) { *result = std::move(s); });
    if (result->has_value()) return fail(Error::kInternal, "callback ran before the call returned");
    if (!run_until([&] { return result->has_value(); })) return fail(Error::kTimeout, "callback never ran");
    return **result;
  }
  Status pause(const SandboxSpec& spec, const RuntimeInfo& info) {
    return await([&](Driver::Done done) { driver_->pause(spec, info, std::move(done)); });
  }
  Status resume(const SandboxSpec& spec, const RuntimeInfo& info) {
    return await([&](Driver::Done done) { driver_->resume(spec, info, std::move(done)); });
  }
  Status terminate(const SandboxSpec& spec, const RuntimeInfo& info) {
    return await([&](Driver::Done done) { driver_->terminate(spec, info, std::move(done)); });
  }

  bool frozen_in_kernel(const SandboxSpec& spec) {
    const std::string state = slurp(cgroups_->sandbox(spec.id).freezer_state_file());
    return state.find("frozen 1") != std::string::npos || state == "FROZEN\n";
  }

  // GETs `path` from the sandbox's own 127.0.0.1:8080, retrying while the server is still starting.
  Result<std::string> http_get(const SandboxSpec& spec, const RuntimeInfo& info, const std::string& path) {
    Failure last{Error::kTimeout, "never tried"};
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (std::chrono::steady_clock::now() < deadline) {
      auto sock = driver_->open_socket(spec, info, 8080);
      if (!sock) return sock.failure();
      if (sock->connected || sock->connect_port != 8080) return fail(Error::kInternal, "not a socket to connect to 8080");
      auto response = http_get_once(std::move(sock->fd), path);
      if (response) return response;
      last = response.failure();
      std::this_thread::sleep_for(50ms);
    }
    return last;
  }

  uv_loop_t loop_;
  bool loop_initialized_ = false;
  std::string state_dir_;
  NodeConfig cfg_;
  std::unique_ptr<snapshot::ImageStore> images_;
  std::optional<CgroupManager> cgroups_;
  std::unique_ptr<Driver> driver_;
  std::vector<std::pair<SandboxSpec, RuntimeInfo>> started_;
};

// A stand-in for sandgate-agent (written by another part of the project): it takes the agent's --listen
// ADDR:PORT and serves HTTP there.
std::string write_agent_script(const std::string& dir, const std::string& body) {
  std::string path = dir + "/fake-agent";
  std::ofstream(path) << "#!/bin/sh\n" << body << "\n";
  ::chmod(path.c_str(), 0755);
  return path;
}

TEST_F(ProcessDriverTest, AgentListensOnTheAgentPortNextToTheCommand) {
  cfg_.agent_path = write_agent_script(
      state_dir_, R"sh([ "$1" = --listen ] || exit 2; mkdir -p /www; echo agent > /www/index.html; exec httpd -f -p "$2" -h /www)sh");
  auto driver = make_process_driver(&loop_, cfg_, images_.get());
  ASSERT_TRUE(driver.ok()) << driver.message();
  driver_ = std::move(*driver);
  SandboxSpec spec = make_spec({"sleep", "1000"}, "with-agent");
  spec.agent_port = 9501;
  auto info = start(spec);
  ASSERT_TRUE(info.ok()) << info.message();
  Failure last{Error::kTimeout, "never tried"};
  bool served = wait_for([&] {
    auto sock = driver_->open_socket(spec, *info, 9501);
    if (!sock) return false;
    auto r = http_get_once(std::move(sock->fd), "/", 9501);
    if (!r) last = r.failure();
    return r && r->starts_with("HTTP/1.") && r->find(" 200 ") != std::string::npos;
  }, 20s);
  EXPECT_TRUE(served) << last.message << "\n" << log_of(spec);
  // The agent lives in the sandbox's cgroup, as a sibling of the command under init.
  EXPECT_GE(pids_in(cgroup_dirs(spec).front()).size(), 3u);
}

TEST_F(ProcessDriverTest, AnAgentThatExitsDoesNotEndTheSandbox) {
  cfg_.agent_path = write_agent_script(state_dir_, "echo agent-ran; exit 3");
  auto driver = make_process_driver(&loop_, cfg_, images_.get());
  ASSERT_TRUE(driver.ok()) << driver.message();
  driver_ = std::move(*driver);
  SandboxSpec spec = make_spec({"sleep", "1000"});
  spec.agent_port = 9501;
  auto info = start(spec);
  ASSERT_TRUE(info.ok()) << info.message();
  // Restarted after 1 s: the log shows two runs, and the sandbox is still there.
  ASSERT_TRUE(wait_for([&] {
    const std::string log = log_of(spec);
    size_t first = log.find("agent-ran");
    return first != std::string::npos && log.find("agent-ran", first + 1) != std::string::npos;
  }, 10s)) << log_of(spec);
  EXPECT_NE(log_of(spec).find("sandgate-agent (pid"), std::string::npos) << log_of(spec);
  EXPECT_TRUE(driver_->observe(spec, *info).alive);
}

TEST_F(ProcessDriverTest, NoAgentWhenTheConfiguredOneIsMissing) {
  cfg_.agent_path = state_dir_ + "/no-such-agent";
  auto driver = make_process_driver(&loop_, cfg_, images_.get());
  ASSERT_TRUE(driver.ok()) << driver.message();
  driver_ = std::move(*driver);
  SandboxSpec spec = make_spec({"sh", "-c", "echo init=$(tr '\\0' ' ' < /proc/1/cmdline); exec sleep 1000"});
  spec.agent_port = 9501;
  auto info = start(spec);
  ASSERT_TRUE(info.ok()) << info.message();
  ASSERT_TRUE(wait_for([&] { return log_of(spec).find("init=") != std::string::npos; }, 10s));
  EXPECT_EQ(log_of(spec).find("--agent"), std::string::npos) << log_of(spec);
}

// What the sandbox leaves in its upper dir is its own business, never a way to steer the next start's
// host-root mkdir/chown/mount at host paths: everything in the root is attached after pivot_root.
TEST_F(ProcessDriverTest, ASymlinkLeftInTheUpperDirCannotPointTheNextStartAtTheHost) {
  cfg_.agent_path = write_agent_script(state_dir_, "exec sleep 1000");
  auto driver = make_process_driver(&loop_, cfg_, images_.get());
  ASSERT_TRUE(driver.ok()) << driver.message();
  driver_ = std::move(*driver);
  const std::string host_dir = state_dir_ + "/host-target";
  ASSERT_EQ(::mkdir(host_dir.c_str(), 0755), 0);
  SandboxSpec spec = make_spec({"sh", "-c",
                                "mv /.sandgate /moved && ln -s " + host_dir + " /.sandgate && echo swapped; "
                                "exec sleep 1000"});
  spec.agent_port = 9501;
  auto first = start(spec);
  ASSERT_TRUE(first.ok()) << first.message();
  ASSERT_TRUE(wait_for([&] { return log_of(spec).find("swapped") != std::string::npos; }, 10s)) << log_of(spec);
  ASSERT_TRUE(terminate(spec, *first).ok());
  started_.clear();
  // The second start may fail (the sandbox broke its own /.sandgate), but it touches nothing of the host.
  auto second = start(spec);
  if (second.ok()) (void)terminate(spec, *second);
  started_.clear();
  EXPECT_TRUE(std::filesystem::is_empty(host_dir)) << "a start wrote into " << host_dir;
}

TEST_F(ProcessDriverTest, DescribesItself) {
  EXPECT_EQ(driver_->name(), "process");
  EXPECT_TRUE(driver_->capabilities().pause);
  EXPECT_FALSE(driver_->capabilities().hibernate);
}

TEST_F(ProcessDriverTest, CommandRunsUnderInitInItsOwnNamespaces) {
  const std::string cwd = "/tmp";
  SandboxSpec spec = make_spec(
      {"sh", "-c",
       R"sh(echo "pid=$$ ppid=$PPID host=$(hostname) id=$SANDGATE_SANDBOX_ID name=$SANDGATE_SANDBOX_NAME )sh"
       R"sh(custom=$CUSTOM home=$HOME path=$PATH cwd=$(pwd) )sh"
       R"sh(init=$(tr '\0' ' ' < /proc/1/cmdline) )sh"
       R"sh(uid_map=$(cat /proc/self/uid_map | tr -s ' ') id=$(id -u) hostfile=$(test -e )sh" +
           state_dir_ + R"sh( && echo yes || echo no)"; exec sleep 1000)sh"},
      "web-one");
  spec.cwd = cwd;
  spec.env = {{"CUSTOM", "yes"}, {"HOME", "/custom-home"}};
  auto info = start(spec);
  ASSERT_TRUE(info.ok()) << info.message();
  EXPECT_EQ(info->sandbox_dir, sandbox_dir(spec));
  EXPECT_EQ(stat_field(info->pid, 22), std::to_string(info->start_time_ticks));

  ASSERT_TRUE(wait_for([&] { return log_of(spec).find("init=") != std::string::npos; }, 10s)) << log_of(spec);
  const std::string log = log_of(spec);
  // The command is the first child of PID 1 (sandgate-init) in a fresh PID namespace.
  EXPECT_NE(log.find("pid=2 ppid=1 "), std::string::npos) << log;
  EXPECT_NE(log.find("host=web-one "), std::string::npos) << log;
  EXPECT_NE(log.find("id=" + spec.id + " name=web-one "), std::string::npos) << log;
  EXPECT_NE(log.find("custom=yes home=/custom-home "), std::string::npos) << log;  // spec.env overrides
  EXPECT_NE(log.find("path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "), std::string::npos) << log;
  EXPECT_NE(log.find("cwd=" + cwd + " "), std::string::npos) << log;
  EXPECT_NE(log.find("init=" + cfg_.init_path + " --hostname web-one"), std::string::npos) << log;
  // Root in its own user namespace (host uid spec.uid_base), on its image's root: the host's files are not there.
  EXPECT_NE(log.find("uid_map= 0 " + std::to_string(spec.uid_base) + " 65536 id=0 "), std::string::npos) << log;
  EXPECT_NE(log.find("hostfile=no"), std::string::npos) << log;

  const std::string pid = std::to_string(info->pid);
  for (const char* ns : {"pid", "mnt", "net", "uts", "ipc", "user", "cgroup"})
    EXPECT_NE(ns_of(pid, ns), ns_of("self", ns)) << ns << " namespace is shared with the host";
  EXPECT_EQ(stat_field(info->pid, 4), std::to_string(::getpid())) << "init is the node's child";
  EXPECT_EQ(stat_field(info->pid, 6), pid) << "init leads its own session";
  for (const auto& dir : cgroup_dirs(spec)) {
    auto pids = pids_in(dir);
    EXPECT_NE(std::find(pids.begin(), pids.end(), info->pid), pids.end()) << dir;
  }
  struct stat st;
  ASSERT_EQ(::stat(sandbox_dir(spec).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
}

// The node's open descriptors, ignored signals and signal mask must not leak into the sandbox.
TEST_F(ProcessDriverTest, SandboxInheritsNoDescriptorsOrSignalStateFromTheNode) {
  UniqueFd leaked(::open("/dev/null", O_RDONLY));  // deliberately without O_CLOEXEC
  ASSERT_TRUE(leaked.valid());
  struct sigaction ignore{}, previous{};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(::sigaction(SIGUSR1, &ignore, &previous), 0);
  sigset_t blocked, previous_mask;
  sigemptyset(&blocked);
  sigaddset(&blocked, SIGUSR2);
  ASSERT_EQ(::sigprocmask(SIG_BLOCK, &blocked, &previous_mask), 0);

  const std::string fd = std::to_string(leaked.get());
  SandboxSpec spec = make_spec({"sh", "-c",
                                "echo leaked=$(test -e /proc/$$/fd/" + fd + " && echo yes || echo no); "
                                // busybox sh ignores SIGINT while it runs a command substitution, so the
                                // dispositions are read by a process exec'd from the top level.
                                "exec grep -E '^Sig(Ign|Blk)' /proc/self/status"});
  auto info = start(spec);
  ::sigaction(SIGUSR1, &previous, nullptr);
  ::sigprocmask(SIG_SETMASK, &previous_mask, nullptr);
  ASSERT_TRUE(info.ok()) << info.message();

  ASSERT_TRUE(wait_for([&] { return log_of(spec).find("SigIgn") != std::string::npos; }, 10s)) << log_of(spec);
  const std::string log = log_of(spec);
  EXPECT_NE(log.find("leaked=no"), std::string::npos) << log;
  EXPECT_NE(log.find("SigBlk:\t0000000000000000"), std::string::npos) << log;
  EXPECT_NE(log.find("SigIgn:\t0000000000000000"), std::string::npos) << log;
}

// sandgate-init passes signals on to the command and exits with its fate (128 + signal when killed).
TEST_F(ProcessDriverTest, InitForwardsSignalsAndExitsWithTheCommandsStatus) {
  SandboxSpec spec = make_spec({"sh", "-c", "echo ready; exec sleep 1000"});
  auto info = start(spec);
  ASSERT_TRUE(info.ok()) << info.message();
  // The signal must find init waiting for it, not still setting up.
  ASSERT_TRUE(wait_for([&] { return log_of(spec).find("ready") != std::string::npos; }, 10s));
  ASSERT_EQ(::kill(info->pid, SIGTERM), 0);
  siginfo_t si{};
  ASSERT_TRUE(wait_for([&] {
    return ::waitid(P_PID, static_cast<id_t>(info->pid), &si, WEXITED | WNOHANG | WNOWAIT) == 0 && si.si_pid != 0;
  }, 10s)) << "init did not pass SIGTERM on";
  EXPECT_EQ(si.si_code, CLD_EXITED);
  EXPECT_EQ(si.si_status, 128 + SIGTERM);
}

// Orphans inside the sandbox are reparented to sandgate-init, which must reap them.
TEST_F(ProcessDriverTest, InitReapsOrphans) {
  SandboxSpec spec = make_spec({"sh", "-c", "(sleep 0.1 &); echo orphaned; exec sleep 1000"});
  auto info = start(spec);
  ASSERT_TRUE(info.ok()) << info.message();
  ASSERT_TRUE(wait_for([&] { return log_of(spec).find("orphaned") != std::string::npos; }, 10s));
  auto zombie_children_of_init = [&] {
    int zombies = 0;
    for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
      const std::string name = entry.path().filename();
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      const int pid = std::stoi(name);
      if (stat_field(pid, 4) == std::to_string(info->pid) && stat_field(pid, 3) == "Z") ++zombies;
    }
    return zombies;
  };
  std::this_thread::sleep_for(400ms);  // the orphan has exited by now
  EXPECT_EQ(zombie_children_of_init(), 0);
}

// The log on the host is capped: past node.log_max_bytes, output.log becomes output.log.1 and starts again.
TEST_F(ProcessDriverTest, OutputLogIsCappedAndRotated) {
  cfg_.log_max_bytes = 64 * 1024;
  auto driver = make_process_driver(&loop_, cfg_, images_.get());
  ASSERT_TRUE(driver.ok()) << driver.message();
  driver_ = std::move(*driver);
  // 300 lines of 1000 bytes (~300 KiB, several times the cap), then a marker.
  SandboxSpec spec = make_spec({"sh", "-c",
                                "i=0; while [ $i -lt 300 ]; do printf '%0999d\\n' $i; i=$((i+1)); done; "
                                "echo last-line; exec sleep 1000"});
  auto info = start(spec);
  ASSERT_TRUE(info.ok()) << info.message();
  ASSERT_TRUE(wait_for([&] { return log_of(spec).find("last-line") != std::string::npos; }, 20s));
  struct stat current {}, previous {};
  ASSERT_EQ(::stat((sandbox_dir(spec) + "/output.log").c_str(), &current), 0);
  ASSERT_EQ(::stat((sandbox_dir(spec) + "/output.log.1").c_str(), &previous), 0);
  EXPECT_LE(current.st_size, 64 * 1024);
  EXPECT_LE(previous.st_size, 64 * 1024);
  EXPECT_GT(previous.st_size, 0);
}

// disk_mb: what the sandbox writes lives on an ext4 file of that size; a write past it fails with ENOSPC.
TEST_F(ProcessDriverTest, DiskMbLimitsWhatTheSandboxCanWrite) {
  SandboxSpec spec = make_spec({"sh", "-c",
                                "dd if=/dev/zero of=/big bs=1M count=64 2>&1; echo dd=$?; "
                                "exec sleep 1000"});
  spec.disk_mb = 16;
  auto info = start(spec);
  ASSERT_TRUE(info.ok()) << info.message();
  ASSERT_TRUE(wait_for([&] { return log_of(spec).find("dd=") != std::string::npos; }, 20s)) << log_of(spec);
  const std::string log = log_of(spec);
  EXPECT_NE(log.find("No space left on device"), std::string::npos) << log;
  EXPECT_NE(log.find("dd=1"), std::string::npos) << log;
  // The image file on the host stays sparse-sized, and nothing reached a plain upper dir.
  struct stat st {};
  ASSERT_EQ(::stat((sandbox_dir(spec) + "/disk.img").c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 16 * 1024 * 1024);
  EXPECT_FALSE(exists(sandbox_dir(spec) + "/upper/big"));
}

TEST_F(ProcessDriverTest, HostnameDefaultsToTheId) {
  SandboxSpec spec = make_spec({"sh", "-c", "echo host=$(hostname); exec sleep 1000"});
  auto info = start(spec);
  ASSERT_TRUE(info.ok()) << info.message();
  ASSERT_TRUE(wait_for([&] { return log_of(spec).find("host=") != std::string::npos; }, 10s));
  EXPECT_NE(log_of(spec).find("host=" + spec.id + "\n"), std::string::npos) << log_of(spec);
}

TEST_F(ProcessDriverTest, LimitsLandInTheRealCgroupFiles) {
  SandboxSpec spec = make_spec({"sleep", "1000"});
  spec.cpus = 0.5;
  spec.memory_mb = 64;
  spec.pids_max = 100;
  auto info = start(spec);
  ASSERT_TRUE(info.ok()) << info.message();
  SandboxCgroup cg = cgroups_->sandbox(spec.id);
  const CgroupDetection& d = cgroups_->detection();
  if (d.memory.version != CgroupVersion::kNone) {
    EXPECT_EQ(slurp(cg.memory_limit_file()), "67108864\n");
  }
  if (d.cpu.version == CgroupVersion::kV1) {
    EXPECT_EQ(slurp(cg.cpu_quota_file()), "50000\n");
  }
  if (d.cpu.version == CgroupVersion::kV2) {
    EXPECT_EQ(slurp(cg.cpu_quota_file()), "50000 100000\n");
  }
  if (d.pids.version != CgroupVersion::kNone) {
    EXPECT_EQ(slurp(cg.pids_max_file()), "100\n");
  }
  if (d.memory.version == CgroupVersion::kNone && d.cpu.version == CgroupVersion::kNone)
    GTEST_SKIP() << "no memory or cpu controller on this host";
}

TEST_F(ProcessDriverTest, PauseFreezesTheSandboxAndResumeThawsIt) {
  SandboxSpec spec = make_spec({"sleep", "1000"});
  auto info = start(spec);
  ASSERT_TRUE(info.ok()) << info.message();

  Status paused = pause(spec, *info);
  ASSERT_TRUE(paused.ok()) << paused.message();
  EXPECT_TRUE(frozen_in_kernel(spec)) << slurp(cgroups_->sandbox(spec.id).freezer_state_file());
  ObservedInstance seen = driver_->observe(spec, *info);
  EXPECT_TRUE(seen.alive);
  EXPECT_TRUE(seen.paused);

  Status resumed = resume(spec, *info);
  ASSERT_TRUE(resumed.ok()) << resumed.message();
  EXPECT_FALSE(frozen_in_kernel(spec));
  seen = driver_->observe(spec, *info);
  EXPECT_TRUE(seen.alive);
  EXPECT_FALSE(seen.paused);
}

TEST_F(ProcessDriverTest, PauseOfAnUnknownSandboxFailsThroughTheCallback) {
  SandboxSpec spec = make_spec({"true"});
  Status paused = pause(spec, RuntimeInfo{});
  ASSERT_FALSE(paused.ok());
  EXPECT_EQ(paused.error(), Error::kNotFound) << paused.message();
  EXPECT_NE(paused.message().find(spec.id), std::string::npos) << paused.message();
}

TEST_F(ProcessDriverTest, TwoSandboxesServeTheSamePortInTheirOwnNetworks) {
  std::vector<std::pair<SandboxSpec, RuntimeInfo>> servers;
  for (const char* marker : {"alpha", "beta"}) {
    // Each writes its marker into its own root filesystem.
    SandboxSpec spec = make_spec({"sh", "-c",
                                  std::string("mkdir /www && echo 'marker ") + marker +
                                      "' > /www/marker.txt && exec httpd -f -p 127.0.0.1:" +
                                      std::to_string(kHttpPort) + " -h /www"},
                                 marker);
    auto info = start(spec);
    ASSERT_TRUE(info.ok()) << info.message();
    servers.emplace_back(spec, *info);
  }
  for (const auto& [spec, info] : servers) {
    auto response = http_get(spec, info, "/marker.txt");
    ASSERT_TRUE(response.ok()) << spec.name << ": " << response.message() << "\nlog:\n" << log_of(spec);
    EXPECT_NE(response->find(" 200 "), std::string::npos) << *response;
    EXPECT_NE(response->find("marker " + spec.name + "\n"), std::string::npos) << *response;
  }
  // The host's own loopback does not reach either server.
  UniqueFd host_sock(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  auto from_host = http_get_once(std::move(host_sock), "/marker.txt");
  if (from_host) {
    EXPECT_EQ(from_host->find("marker "), std::string::npos) << *from_host;
  }
}

TEST_F(ProcessDriverTest, MissingCommandExits127AndTheWatchFiresOnce) {
  SandboxSpec spec = make_spec({"/definitely/missing/command"});
  auto info = start(spec);
  ASSERT_TRUE(info.ok()) << info.message();

  // Peek at the init's exit without reaping it (WNOWAIT), so the watch still has an exit to see.
  siginfo_t si{};
  ASSERT_TRUE(wait_for([&] {
    si = {};
    return ::waitid(P_PID, static_cast<id_t>(info->pid), &si, WEXITED | WNOHANG | WNOWAIT) == 0 && si.si_pid != 0;
  }, 10s));
  EXPECT_EQ(si.si_code, CLD_EXITED);
  EXPECT_EQ(si.si_status, 127);
  EXPECT_NE(log_of(spec).find("cannot execute /definitely/missing/command: No such file or directory"),
            std::string::npos)
      << log_of(spec);
  EXPECT_FALSE(driver_->observe(spec, *info).alive) << "a zombie is not alive";

  int fired = 0;
  ASSERT_TRUE(driver_->watch_exit(spec, *info, [&] { ++fired; }).ok());
  EXPECT_EQ(fired, 0) << "on_exit ran inside watch_exit";
  ASSERT_TRUE(run_until([&] { return fired > 0; }));
  run_until([] { return false; }, 100ms);
  EXPECT_EQ(fired, 1);
  errno = 0;
  EXPECT_EQ(::waitpid(info->pid, nullptr, WNOHANG), -1) << "the watch did not reap its child";
  EXPECT_EQ(errno, ECHILD);
}

TEST_F(ProcessDriverTest, WatchFiresWhenTheCommandFinishes) {
  SandboxSpec spec = make_spec({"sh", "-c", "sleep 0.2; exit 3"});
  auto info = start(spec);
  ASSERT_TRUE(info.ok()) << info.message();
  int fired = 0;
  ASSERT_TRUE(driver_->watch_exit(spec, *info, [&] { ++fired; }).ok());
  EXPECT_TRUE(driver_->observe(spec, *info).alive);
  ASSERT_TRUE(run_until([&] { return fired > 0; }));
  EXPECT_EQ(fired, 1);
  EXPECT_FALSE(driver_->observe(spec, *info).alive);
}

TEST_F(ProcessDriverTest, UnwatchStopsTheWatch) {
  SandboxSpec spec = make_spec({"sh", "-c", "sleep 0.2"});
  auto info = start(spec);
  ASSERT_TRUE(info.ok()) << info.message();
  int fired = 0;
  ASSERT_TRUE(driver_->watch_exit(spec, *info, [&] { ++fired; }).ok());
  driver_->unwatch(spec);
  siginfo_t si{};
  ASSERT_TRUE(wait_for([&] {
    return ::waitid(P_PID, static_cast<id_t>(info->pid), &si, WEXITED | WNOHANG | WNOWAIT) == 0 && si.si_pid != 0;
  }, 10s));
  run_until([] { return false; }, 100ms);
  EXPECT_EQ(fired, 0);
}

TEST_F(ProcessDriverTest, NonexistentInitFailsStartAndLeavesNoCgroup) {
  cfg_.init_path = "/nonexistent/sandgate-init";
  auto broken = make_process_driver(&loop_, cfg_, images_.get());
  ASSERT_TRUE(broken.ok()) << broken.message();
  SandboxSpec spec = make_spec({"sleep", "1000"});
  auto info = start_with(**broken, spec);
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.error(), Error::kNotFound);
  EXPECT_NE(info.message().find("/nonexistent/sandgate-init: No such file or directory"), std::string::npos)
      << info.message();
  EXPECT_NE(info.message().find(spec.id), std::string::npos) << info.message();
  for (const auto& dir : cgroup_dirs(spec)) EXPECT_FALSE(exists(dir)) << dir;
}

TEST_F(ProcessDriverTest, TerminateKillsEveryProcessOfAPausedSandboxAndRemovesItsCgroup) {
  SandboxSpec spec = make_spec({"sh", "-c", "sleep 1000 & sleep 1000 & wait"});
  auto info = start(spec);
  ASSERT_TRUE(info.ok()) << info.message();
  SandboxCgroup cg = cgroups_->sandbox(spec.id);
  ASSERT_FALSE(cg.dirs().empty());
  std::vector<int> pids;
  ASSERT_TRUE(wait_for([&] { return (pids = pids_in(cg.dirs()[0])).size() == 4; }, 10s))
      << "expected init, sh and two sleeps, got " << pids.size();
  ASSERT_TRUE(pause(spec, *info).ok());

  int fired = 0;
  ASSERT_TRUE(driver_->watch_exit(spec, *info, [&] { ++fired; }).ok());
  Status terminated = terminate(spec, *info);
  ASSERT_TRUE(terminated.ok()) << terminated.message();
  for (int pid : pids) EXPECT_FALSE(exists("/proc/" + std::to_string(pid))) << "pid " << pid << " survived";
  for (const auto& dir : cg.dirs()) EXPECT_FALSE(exists(dir)) << dir;
  EXPECT_FALSE(driver_->observe(spec, *info).alive);
  EXPECT_EQ(fired, 0) << "a terminated sandbox did not exit by itself";

  Status again = terminate(spec, *info);
  EXPECT_TRUE(again.ok()) << "terminate is idempotent: " << again.message();
}

// libuv's clock only advances when the loop runs. A node busy elsewhere for longer than the terminate
// deadline (5 s) must not see that deadline expire the moment the loop runs again.
TEST_F(ProcessDriverTest, TerminateAfterTheLoopSatIdleStillWaitsForTheInit) {
  SandboxSpec spec = make_spec({"sleep", "1000"});
  auto info = start(spec);
  ASSERT_TRUE(info.ok()) << info.message();
  std::this_thread::sleep_for(5200ms);
  Status terminated = terminate(spec, *info);
  EXPECT_TRUE(terminated.ok()) << terminated.message();
}

TEST_F(ProcessDriverTest, ObserveTellsTheInstanceFromAReusedPid) {
  SandboxSpec spec = make_spec({"sleep", "1000"});
  auto info = start(spec);
  ASSERT_TRUE(info.ok()) << info.message();
  EXPECT_TRUE(driver_->observe(spec, *info).alive);
  // The namespace handed to the proxy with spares (for its socket maker) is the one its sockets live in.
  auto sock = driver_->open_socket(spec, *info, 8080);
  auto netns = driver_->socket_namespace(spec, *info);
  ASSERT_TRUE(sock.ok() && netns.ok()) << netns.message();
  EXPECT_EQ(testing::namespace_inode(netns->get()), testing::socket_namespace_inode(sock->fd.get()));
  EXPECT_NE(testing::namespace_inode(netns->get()), testing::own_netns_inode()) << "not the node's";
  RuntimeInfo impostor = *info;
  impostor.start_time_ticks += 1;
  EXPECT_FALSE(driver_->observe(spec, impostor).alive);
  EXPECT_FALSE(driver_->open_socket(spec, impostor, 8080).ok());
  EXPECT_FALSE(driver_->socket_namespace(spec, impostor).ok()) << "not a process that reused the pid";
  ASSERT_TRUE(terminate(spec, *info).ok());
  EXPECT_FALSE(driver_->observe(spec, *info).alive);
  EXPECT_EQ(driver_->open_socket(spec, *info, 8080).error(), Error::kUnavailable);
}

// A sandbox outlives the node that started it (no parent-death signal), and another node instance can
// watch and terminate it although it is not that node's child.
TEST_F(ProcessDriverTest, SandboxOutlivesItsNodeAndIsAdopted) {
  SandboxSpec spec = make_spec({"sleep", "1000"});
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  pid_t node = ::fork();
  ASSERT_GE(node, 0);
  if (node == 0) {
    // The short-lived "node": its own loop and driver, start, report, exit without cleaning up.
    uv_loop_t loop;
    uv_loop_init(&loop);
    auto driver = make_process_driver(&loop, cfg_, images_.get());
    if (!driver) ::_exit(2);
    std::optional<Result<RuntimeInfo>> started;
    (*driver)->start(spec, sandbox_dir(spec), [&](Result<RuntimeInfo> r) { started.emplace(std::move(r)); });
    while (!started) uv_run(&loop, UV_RUN_ONCE);
    if (!*started) ::_exit(3);
    RuntimeInfo reported = **started;
    ssize_t n = ::write(pipe_fds[1], &reported.pid, sizeof reported.pid);
    n += ::write(pipe_fds[1], &reported.start_time_ticks, sizeof reported.start_time_ticks);
    ::_exit(n == sizeof reported.pid + sizeof reported.start_time_ticks ? 0 : 4);
  }
  ::close(pipe_fds[1]);
  RuntimeInfo info;
  info.sandbox_dir = sandbox_dir(spec);
  ASSERT_EQ(::read(pipe_fds[0], &info.pid, sizeof info.pid), static_cast<ssize_t>(sizeof info.pid));
  ASSERT_EQ(::read(pipe_fds[0], &info.start_time_ticks, sizeof info.start_time_ticks),
            static_cast<ssize_t>(sizeof info.start_time_ticks));
  ::close(pipe_fds[0]);
  started_.emplace_back(spec, info);
  int status = 0;
  ASSERT_EQ(::waitpid(node, &status, 0), node);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "node child failed: " << status;

  std::this_thread::sleep_for(100ms);
  EXPECT_TRUE(driver_->observe(spec, info).alive) << "the sandbox died with its node";
  EXPECT_NE(stat_field(info.pid, 4), std::to_string(::getpid())) << "not our child: adopted";

  int fired = 0;
  ASSERT_TRUE(driver_->watch_exit(spec, info, [&] { ++fired; }).ok());
  ASSERT_EQ(::kill(info.pid, SIGKILL), 0);
  ASSERT_TRUE(run_until([&] { return fired > 0; }));
  EXPECT_EQ(fired, 1);
  Status terminated = terminate(spec, info);
  EXPECT_TRUE(terminated.ok()) << terminated.message();
  for (const auto& dir : cgroup_dirs(spec)) EXPECT_FALSE(exists(dir)) << dir;
}

}  // namespace
}  // namespace sg
