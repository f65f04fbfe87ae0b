#include "common/token_digest.h"
#include "noderuntime/node.h"
#include "noderuntime/fork.h"

#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>

#include "noderuntime/names.h"
#include "snapshot/layer_store.h"
#include "tests/unit/node/fake_driver.h"

namespace sg {
namespace {

using S = SandboxState;
using testing::FakeDriver;
using testing::run_for;
using testing::run_until;
using testing::TempDir;

// A fake under another driver's name, for what the node decides by driver name (validate()).
class NamedFakeDriver : public FakeDriver {
 public:
  NamedFakeDriver(uv_loop_t* loop, std::string name) : FakeDriver(loop), name_(std::move(name)) {}
  std::string_view name() const override { return name_; }

 private:
  std::string name_;
};

class NodeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(uv_loop_init(&loop_), 0);
    make_node();
  }
  void TearDown() override {
    node_.reset();
    uv_run(&loop_, UV_RUN_DEFAULT);
    EXPECT_EQ(uv_loop_close(&loop_), 0);
  }

  // `node_toml`: extra lines for the [node] table. `more_drivers`: fakes named so, after the default one.
  void make_node(const std::string& node_toml = "", std::map<std::string, FakeDriver::Instance> instances = {},
                 const std::vector<std::string>& more_drivers = {}) {
    auto cfg = load_config_string("[node]\nstate_dir = \"" + dir_.path() + "\"\n" + node_toml, "test.toml");
    ASSERT_TRUE(cfg.ok()) << cfg.message();
    config_ = std::make_unique<ConfigHolder>(*cfg);
    auto driver = std::make_unique<FakeDriver>(&loop_);
    driver->instances = std::move(instances);
    driver_ = driver.get();
    auto store = Store::open(dir_.path() + "/node.db");
    ASSERT_TRUE(store.ok()) << store.message();
    std::vector<std::unique_ptr<Driver>> drivers;
    drivers.push_back(std::move(driver));
    for (const std::string& name : more_drivers) drivers.push_back(std::make_unique<NamedFakeDriver>(&loop_, name));
    node_ = std::make_unique<Node>(&loop_, config_.get(), std::move(drivers), std::move(*store));
  }

  // Simulates a node crash + restart: the instances live on, the in-flight driver operations are lost.
  void restart(const std::string& node_toml = "") {
    auto instances = driver_->instances;
    for (auto& [id, inst] : instances) inst.on_exit = nullptr;
    node_.reset();
    uv_run(&loop_, UV_RUN_NOWAIT);
    make_node(node_toml, std::move(instances));
  }

  CreateRequest request(std::optional<std::string> name, bool ephemeral = false, int64_t timeout_secs = 300) {
    CreateRequest r;
    r.name = std::move(name);
    r.command = {"sleep", "infinity"};
    r.exposed_ports = {8080};
    r.ephemeral = ephemeral;
    r.timeout_secs = timeout_secs;
    return r;
  }

  // Runs the loop until the create is answered.
  Result<SandboxInfo> create_request(const CreateRequest& r) {
    std::optional<Result<SandboxInfo>> out;
    node_->create(r, [&out](Result<SandboxInfo> info) { out.emplace(std::move(info)); });
    if (!run_until(&loop_, [&] { return out.has_value(); })) return fail(Error::kTimeout, "create never answered");
    return std::move(*out);
  }

  SandboxInfo create(std::optional<std::string> name, bool ephemeral = false, int64_t timeout_secs = 300) {
    auto info = create_request(request(std::move(name), ephemeral, timeout_secs));
    EXPECT_TRUE(info.ok()) << info.message();
    return info.ok() ? *info : SandboxInfo{};
  }

  std::optional<S> state(const std::string& ref) {
    auto info = node_->get(ref);
    if (!info) return std::nullopt;
    return info->state;
  }

  bool hibernated(const std::string& ref) {
    auto info = node_->get(ref);
    return info && info->state == S::kSuspended && info->tier == SuspendTier::kDisk;
  }

  bool wait_state(const std::string& ref, S want, int timeout_ms = 3000) {
    return run_until(&loop_, [&] { return state(ref) == want; }, timeout_ms);
  }

  void suspend_and_wait(const std::string& ref) {
    auto outcome = node_->suspend(ref);
    ASSERT_TRUE(outcome.ok()) << outcome.message();
    ASSERT_TRUE(wait_state(ref, S::kSuspended));
  }

  struct OpenResult {
    std::optional<Result<OpenedPort>> result;
  };
  std::shared_ptr<OpenResult> open(const std::string& ref, uint16_t port = 8080, uint32_t timeout_ms = 5000) {
    auto out = std::make_shared<OpenResult>();
    node_->open(ref, port, timeout_ms, [out](Result<OpenedPort> r) { out->result.emplace(std::move(r)); });
    return out;
  }

  // Sends `report` every 300 ms, like a proxy worker, while the loop runs for `ms`.
  void report_every_300ms_for(int ms, ActivityReport report) {
    struct Reporter {
      uv_timer_t timer;
      Node* node;
      ActivityReport report;
    } r{{}, node_.get(), std::move(report)};
    uv_timer_init(&loop_, &r.timer);
    r.timer.data = &r;
    uv_timer_start(&r.timer, [](uv_timer_t* t) {
      auto* self = static_cast<Reporter*>(t->data);
      self->node->activity({self->report});
    }, 300, 300);
    run_for(&loop_, ms);
    uv_close(reinterpret_cast<uv_handle_t*>(&r.timer), nullptr);
    run_for(&loop_, 1);  // the close callback runs before `r` goes out of scope
  }

  std::optional<Result<SandboxInfo>> remove(const std::string& ref) {
    std::optional<Result<SandboxInfo>> out;
    node_->remove(ref, [&out](Result<SandboxInfo> r) { out.emplace(std::move(r)); });
    run_until(&loop_, [&] { return out.has_value(); });
    return out;
  }

  uv_loop_t loop_;
  TempDir dir_;
  std::unique_ptr<ConfigHolder> config_;
  FakeDriver* driver_ = nullptr;
  std::unique_ptr<Node> node_;
};

// One uid range per sandbox: distinct while both live, the lowest free one reused once a sandbox is gone.
TEST_F(NodeTest, EachSandboxGetsAUidRangeOfItsOwnAndARemovedOnesIsReused) {
  SandboxInfo a = create("a");
  SandboxInfo b = create("b");
  EXPECT_EQ(a.spec.uid_base, 0x10000000u);
  EXPECT_EQ(b.spec.uid_base, 0x10000000u + kUidRangeSize);
  auto removed = remove("a");
  ASSERT_TRUE(removed && removed->ok());
  SandboxInfo c = create("c");
  EXPECT_EQ(c.spec.uid_base, 0x10000000u);
}

TEST_F(NodeTest, CreateStartsWatchesAndPersists) {
  SandboxInfo info = create("demo");
  EXPECT_EQ(info.state, S::kRunning);
  EXPECT_TRUE(info.spec.id.starts_with("sb-"));
  EXPECT_EQ(info.spec.name, "demo");
  EXPECT_EQ(info.spec.cwd, "/");
  EXPECT_EQ(info.spec.memory_mb, 512u);
  EXPECT_EQ(info.spec.pids_max, 1024u);  // node.default_pids_max
  EXPECT_EQ(info.spec.image, "default");  // node.default_image
  EXPECT_EQ(info.spec.uid_base, 0x10000000u);  // the first slot of node.uid_range_base
  EXPECT_DOUBLE_EQ(info.spec.cpus, 1.0);
  EXPECT_GT(info.runtime.pid, 0);
  EXPECT_TRUE(info.idle_deadline_at_ms.has_value());
  EXPECT_EQ(driver_->starts, 1);
  EXPECT_EQ(driver_->watches, 1);
  EXPECT_TRUE(std::filesystem::is_directory(dir_.path() + "/sandboxes/" + info.spec.id));
  EXPECT_EQ(node_->get("demo")->spec.id, info.spec.id);
  EXPECT_EQ(node_->get(info.spec.id)->spec.name, "demo");
  EXPECT_EQ(node_->list().size(), 1u);
  auto store = Store::open(dir_.path() + "/node.db");
  ASSERT_TRUE(store.ok());
  auto rows = (*store)->load_live();
  ASSERT_EQ(rows->size(), 1u);
  EXPECT_EQ((*rows)[0].state, S::kRunning);
  EXPECT_EQ((*rows)[0].runtime.pid, info.runtime.pid);
}

// A QEMU sandbox's default image is node.qemu_image (empty: the initramfs alone, no image recorded, not
// node.default_image); an explicit image wins and counts as in use. Internet access: process and qemu only.
TEST_F(NodeTest, QemuSandboxesDefaultToTheQemuImageAndMayHaveInternetAccess) {
  make_node("", {}, {"qemu", "firecracker"});
  CreateRequest r = request("q");
  r.driver = "qemu";
  r.allow_internet_access = true;
  auto initramfs = create_request(r);
  ASSERT_TRUE(initramfs.ok()) << initramfs.message();
  EXPECT_EQ(initramfs->spec.image, "");
  EXPECT_TRUE(initramfs->spec.allow_internet_access);
  EXPECT_FALSE(node_->image_users()->claim_for_removal("default"));  // no user: the claim succeeds
  node_->image_users()->release_removal("default");

  r.name = "qx";
  r.image = "disk";
  auto explicit_image = create_request(r);
  ASSERT_TRUE(explicit_image.ok()) << explicit_image.message();
  EXPECT_EQ(explicit_image->spec.image, "disk");
  auto user = node_->image_users()->claim_for_removal("disk");
  ASSERT_TRUE(user);
  EXPECT_NE(user->find(explicit_image->spec.id), std::string::npos) << *user;

  r.name = "qe";
  r.image = "";
  auto empty = create_request(r);
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.error(), Error::kInvalidArgument);

  r.name = "fc";
  r.image.reset();
  r.driver = "firecracker";
  auto firecracker = create_request(r);
  ASSERT_FALSE(firecracker.ok());
  EXPECT_EQ(firecracker.error(), Error::kInvalidArgument);
  EXPECT_NE(firecracker.message().find("only process and qemu"), std::string::npos) << firecracker.message();

  node_.reset();
  uv_run(&loop_, UV_RUN_NOWAIT);
  make_node("qemu_image = \"qimg\"\n", {}, {"qemu"});
  r.name = "qd";
  r.driver = "qemu";
  auto defaulted = create_request(r);
  ASSERT_TRUE(defaulted.ok()) << defaulted.message();
  EXPECT_EQ(defaulted->spec.image, "qimg");
  EXPECT_EQ(create("p").spec.image, "default");  // process sandboxes keep node.default_image
}

TEST_F(NodeTest, DefaultTimeoutComesFromTheConfig) {
  make_node("default_timeout_secs = 42\n");
  CreateRequest r = request("demo");
  r.timeout_secs.reset();
  auto info = create_request(r);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->spec.timeout_secs, 42u);
}

TEST_F(NodeTest, UnnamedSandboxesAreFoundById) {
  SandboxInfo a = create(std::nullopt);
  SandboxInfo b = create(std::nullopt);
  EXPECT_NE(a.spec.id, b.spec.id);
  EXPECT_TRUE(node_->get(a.spec.id).ok());
  EXPECT_EQ(node_->get("nope").error(), Error::kNotFound);
}

TEST_F(NodeTest, SuspendAndResumeAnswers) {
  create("demo");
  auto first = node_->suspend("demo");
  ASSERT_TRUE(first.ok());
  EXPECT_TRUE(first->started);  // 202
  EXPECT_EQ(first->sandbox.state, S::kSuspending);
  auto again = node_->suspend("demo");
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->started);  // 200: already suspending
  ASSERT_TRUE(wait_state("demo", S::kSuspended));
  EXPECT_FALSE(node_->get("demo")->idle_deadline_at_ms.has_value());
  EXPECT_FALSE(node_->suspend("demo")->started);  // 200: already suspended

  auto resume = node_->resume("demo");
  ASSERT_TRUE(resume.ok());
  EXPECT_TRUE(resume->started);
  EXPECT_EQ(resume->sandbox.state, S::kResuming);
  EXPECT_FALSE(node_->resume("demo")->started);  // already resuming
  auto while_resuming = node_->suspend("demo");
  ASSERT_FALSE(while_resuming.ok());
  EXPECT_EQ(while_resuming.error(), Error::kConflict);  // 409
  ASSERT_TRUE(wait_state("demo", S::kRunning));
  EXPECT_FALSE(node_->resume("demo")->started);  // 200: already running
  EXPECT_EQ(node_->get("demo")->state_reason, "resumed on request");
  EXPECT_EQ(driver_->pauses, 1);
  EXPECT_EQ(driver_->resumes, 1);

  EXPECT_EQ(node_->suspend("missing").error(), Error::kNotFound);
  EXPECT_EQ(node_->resume("sb-000000000000").error(), Error::kNotFound);
}

TEST_F(NodeTest, EphemeralSandboxesCannotBeSuspendedOrResumed) {
  create("temp", true);
  EXPECT_EQ(node_->suspend("temp").error(), Error::kInvalidArgument);
  EXPECT_EQ(node_->resume("temp").error(), Error::kInvalidArgument);
  EXPECT_EQ(driver_->pauses, 0);
}

TEST_F(NodeTest, FailedSandboxesCannotBeSuspendedOrResumed) {
  SandboxInfo info = create("demo");
  driver_->exit(info.spec.id);
  ASSERT_EQ(state("demo"), S::kFailed);
  EXPECT_EQ(node_->suspend("demo").error(), Error::kConflict);
  EXPECT_EQ(node_->resume("demo").error(), Error::kConflict);
}

TEST_F(NodeTest, ResumeDuringSuspendCancelsIt) {
  create("demo");
  driver_->op_delay_ms = 2000;
  ASSERT_TRUE(node_->suspend("demo")->started);
  auto r = node_->resume("demo");
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->started);
  ASSERT_TRUE(wait_state("demo", S::kRunning, 500)) << "the cancel is the short way back, not a 2 s pause";
  EXPECT_EQ(driver_->pauses, 1);
  EXPECT_EQ(driver_->cancels, 1);
  EXPECT_EQ(driver_->resumes, 0);
  EXPECT_EQ(node_->get("demo")->state_reason, "suspend cancelled: resumed on request");
  EXPECT_TRUE(node_->get("demo")->idle_deadline_at_ms.has_value());
}

TEST_F(NodeTest, ResumeDuringAnUncancellableSuspendRunsAfterIt) {
  create("demo");
  driver_->can_cancel = false;
  ASSERT_TRUE(node_->suspend("demo")->started);
  auto r = node_->resume("demo");
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->started);
  ASSERT_TRUE(run_until(&loop_, [&] { return driver_->resumes == 1 && state("demo") == S::kRunning; }));
  EXPECT_EQ(driver_->pauses, 1);
}

TEST_F(NodeTest, SingleFlightWakeForManyOpens) {
  create("demo");
  suspend_and_wait("demo");
  std::vector<std::shared_ptr<OpenResult>> opens;
  for (int i = 0; i < 100; ++i) opens.push_back(open("demo"));
  EXPECT_EQ(state("demo"), S::kResuming);
  ASSERT_TRUE(run_until(&loop_, [&] {
    return std::all_of(opens.begin(), opens.end(), [](auto& o) { return o->result.has_value(); });
  }));
  EXPECT_EQ(driver_->resumes, 1);
  EXPECT_EQ(driver_->sockets, 100);
  for (auto& o : opens) {
    ASSERT_TRUE(o->result->ok()) << o->result->message();
    const OpenedPort& p = o->result->value();
    EXPECT_TRUE(p.socket.fd.valid());
    EXPECT_TRUE(p.woke);
    EXPECT_GT(p.wake_ms, 0);
    EXPECT_EQ(p.port, 8080);
    EXPECT_EQ(p.name, "demo");
  }
  EXPECT_EQ(state("demo"), S::kRunning);
  EXPECT_EQ(node_->get("demo")->state_reason, "woken by a connection to port 8080");
}

// A ClientHello carries no credential: it wakes a sleeping sandbox early only for a public port or a client
// address whose credential verified for that sandbox (noderuntime/prewake_gate.h), and is never activity.
TEST_F(NodeTest, AClientHelloWakesASleepingSandboxOnlyForAClientThatOpenedItWithAToken) {
  using P = Node::PrewakeOutcome;
  auto wall_now = [] {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  };
  CreateRequest r = request("demo");
  r.ports.push_back({9000, true, std::nullopt});
  const std::string id = create_request(r)->spec.id;
  EXPECT_EQ(node_->prewake("demo", 8080, "10.0.0.1"), P::kNotAsleep) << "running";
  suspend_and_wait("demo");
  EXPECT_EQ(node_->prewake("demo", 8080, "10.0.0.1"), P::kRefused) << "never verified";
  EXPECT_EQ(node_->prewake("demo", 8080, ""), P::kRefused) << "no address";
  EXPECT_EQ(node_->prewake("demo", 7777, "10.0.0.1"), P::kUnavailable) << "a port it does not expose";
  EXPECT_EQ(node_->prewake("nobody", 8080, "10.0.0.1"), P::kUnavailable);
  EXPECT_EQ(state("demo"), S::kSuspended);
  node_->credential_verified(id, "10.0.0.1");
  EXPECT_EQ(node_->prewake("demo", 8080, "10.0.0.2"), P::kRefused) << "another address";
  EXPECT_EQ(node_->prewake("demo", 8080, "10.0.0.1"), P::kWoke);
  EXPECT_EQ(state("demo"), S::kResuming);
  EXPECT_EQ(node_->prewake("demo", 8080, "10.0.0.1"), P::kNotAsleep) << "already waking";
  // The open that follows joins the wake: one resume.
  auto o = open("demo");
  ASSERT_TRUE(run_until(&loop_, [&] { return o->result.has_value(); }));
  ASSERT_TRUE(o->result->ok()) << o->result->message();
  EXPECT_EQ(driver_->resumes, 1);
  EXPECT_EQ(node_->get("demo")->state_reason, "woken at a ClientHello for port 8080");
  EXPECT_TRUE(o->result->value().woke) << "the open whose ClientHello woke it says so";
  // A public port: anyone's ClientHello, as anyone's request would. Not activity: with no open waiting,
  // the idle clock gives the announced request the grace, not the whole 300 s timeout.
  suspend_and_wait("demo");
  EXPECT_EQ(node_->prewake("demo", 9000, "192.0.2.9"), P::kWoke);
  ASSERT_TRUE(wait_state("demo", S::kRunning));
  const int64_t deadline_in_ms = *node_->get("demo")->idle_deadline_at_ms - wall_now();
  EXPECT_LE(deadline_in_ms, 30'000) << deadline_in_ms;
  EXPECT_GT(deadline_in_ms, 25'000) << deadline_in_ms;
  // The open after the resume finished still reports the wake (and touches the clock), the next one does not.
  for (bool woke : {true, false}) {
    auto after = open("demo", 9000);
    ASSERT_TRUE(run_until(&loop_, [&] { return after->result.has_value(); }));
    ASSERT_TRUE(after->result->ok()) << after->result->message();
    EXPECT_EQ(after->result->value().woke, woke);
  }
  EXPECT_GT(*node_->get("demo")->idle_deadline_at_ms - wall_now(), 250'000) << "the open touched it";
  // A rotated token: the addresses that showed the old one wake nothing any more.
  suspend_and_wait("demo");
  ASSERT_TRUE(node_->rotate_token("demo"));
  EXPECT_EQ(node_->prewake("demo", 8080, "10.0.0.1"), P::kRefused);
  // node.prewake_window_secs = 0: no private port at a ClientHello.
  auto zero = load_config_string("[node]\nstate_dir = \"" + dir_.path() + "\"\nprewake_window_secs = 0\n", "test.toml");
  ASSERT_TRUE(zero.ok()) << zero.message();
  config_->swap(*zero);
  suspend_and_wait("demo");
  EXPECT_EQ(node_->prewake("demo", 8080, "10.0.0.1"), P::kRefused);
  std::string metrics = node_->metrics_text();
  EXPECT_NE(metrics.find("sandgate_node_prewakes_total{result=\"woke\"} 2"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("sandgate_node_prewakes_total{result=\"refused\"} 5"), std::string::npos) << metrics;
}

TEST_F(NodeTest, OpensDuringSuspendCancelItOnce) {
  create("demo");
  driver_->op_delay_ms = 2000;
  ASSERT_TRUE(node_->suspend("demo")->started);
  std::vector<std::shared_ptr<OpenResult>> opens;
  for (int i = 0; i < 20; ++i) opens.push_back(open("demo"));
  ASSERT_TRUE(run_until(&loop_, [&] {
    return std::all_of(opens.begin(), opens.end(), [](auto& o) { return o->result.has_value(); });
  }, 500));
  EXPECT_EQ(driver_->pauses, 1);
  EXPECT_EQ(driver_->cancels, 1) << "one cancel, however many opens";
  EXPECT_EQ(driver_->resumes, 0);
  for (auto& o : opens) EXPECT_TRUE(o->result->ok());
  EXPECT_EQ(state("demo"), S::kRunning);
}

TEST_F(NodeTest, OpensDuringAnUncancellableSuspendLetItFinishThenResumeOnce) {
  create("demo");
  driver_->can_cancel = false;
  ASSERT_TRUE(node_->suspend("demo")->started);
  std::vector<std::shared_ptr<OpenResult>> opens;
  for (int i = 0; i < 20; ++i) opens.push_back(open("demo"));
  ASSERT_TRUE(run_until(&loop_, [&] {
    return std::all_of(opens.begin(), opens.end(), [](auto& o) { return o->result.has_value(); });
  }));
  EXPECT_EQ(driver_->pauses, 1);
  EXPECT_EQ(driver_->resumes, 1);
  for (auto& o : opens) EXPECT_TRUE(o->result->ok());
  EXPECT_EQ(state("demo"), S::kRunning);
}

TEST_F(NodeTest, OpenOfARunningSandboxAnswersAtOnce) {
  create("demo");
  auto o = open("demo");
  ASSERT_TRUE(o->result.has_value()) << "no wake needed, so no waiting";
  ASSERT_TRUE(o->result->ok());
  EXPECT_FALSE(o->result->value().woke);
  EXPECT_EQ(o->result->value().wake_ms, 0);
}

TEST_F(NodeTest, EachWaiterHasItsOwnTimeout) {
  create("demo");
  suspend_and_wait("demo");
  driver_->op_delay_ms = 300;
  auto impatient = open("demo", 8080, 20);
  auto patient = open("demo", 8080, 5000);
  ASSERT_TRUE(run_until(&loop_, [&] { return impatient->result.has_value(); }));
  ASSERT_FALSE(impatient->result->ok());
  EXPECT_EQ(impatient->result->error(), Error::kTimeout);
  EXPECT_FALSE(patient->result.has_value());
  ASSERT_TRUE(run_until(&loop_, [&] { return patient->result.has_value(); }));
  EXPECT_TRUE(patient->result->ok());
  EXPECT_EQ(driver_->resumes, 1);
}

TEST_F(NodeTest, OpenErrors) {
  SandboxInfo info = create("demo");
  auto unknown = open("nope");
  ASSERT_TRUE(unknown->result.has_value());
  EXPECT_EQ(unknown->result->error(), Error::kNotFound);
  auto closed_port = open("demo", 9999);
  EXPECT_EQ(closed_port->result->error(), Error::kPermissionDenied);
  EXPECT_NE(closed_port->result->message().find("port not exposed"), std::string::npos);
  driver_->fail_open_socket = true;
  EXPECT_EQ(open("demo")->result->error(), Error::kIo);
  driver_->fail_open_socket = false;
  driver_->exit(info.spec.id);
  EXPECT_EQ(open("demo")->result->error(), Error::kUnavailable);
  ASSERT_TRUE(remove("demo")->ok());
  EXPECT_EQ(open("demo")->result->error(), Error::kNotFound);
}

TEST_F(NodeTest, OpensCountAsActivity) {
  create("demo");
  int64_t before = *node_->get("demo")->idle_deadline_at_ms;
  run_for(&loop_, 30);
  open("demo");
  EXPECT_GT(*node_->get("demo")->idle_deadline_at_ms, before);
}

TEST_F(NodeTest, IdleExpirySuspendsNamedAndTerminatesEphemeral) {
  SandboxInfo named = create("named", false, 1);
  SandboxInfo ephemeral = create(std::nullopt, true, 1);
  SandboxInfo busy = create("busy", false, 1);
  // Traffic keeps "busy" awake past its timeout.
  uv_timer_t traffic;
  uv_timer_init(&loop_, &traffic);
  traffic.data = node_.get();
  uv_timer_start(&traffic, [](uv_timer_t* t) {
    static_cast<Node*>(t->data)->activity({ActivityReport{"busy", "w1", 10, 20, 1}});
  }, 200, 200);
  bool expired = run_until(&loop_, [&] {
    return state("named") == S::kSuspended && !node_->get(ephemeral.spec.id).ok();
  }, 4000);
  uv_close(reinterpret_cast<uv_handle_t*>(&traffic), nullptr);
  run_for(&loop_, 1);
  ASSERT_TRUE(expired);
  EXPECT_EQ(node_->get("named")->state_reason, "idle for 1 s");
  EXPECT_EQ(state("busy"), S::kRunning);
  EXPECT_EQ(driver_->pauses, 1);
  EXPECT_EQ(driver_->terminates, 1);
}

TEST_F(NodeTest, IdleWithoutPauseSupportKeepsRunning) {
  driver_->can_pause = false;
  create("named", false, 1);
  run_for(&loop_, 1300);
  EXPECT_EQ(state("named"), S::kRunning);
  EXPECT_EQ(driver_->pauses, 0);
  EXPECT_EQ(node_->suspend("named").error(), Error::kUnsupported);
}

// A report carries bytes moved up to an interval earlier, so bytes that arrive after a suspend are no
// evidence of traffic after it: they never wake. The answer names the sleeping sandbox instead.
TEST_F(NodeTest, TrafficReportedAfterASuspendNeverWakesIt) {
  SandboxInfo info = create("demo");
  auto before = open("demo");
  ASSERT_TRUE(before->result.has_value() && before->result->ok());
  suspend_and_wait("demo");
  std::vector<AsleepSandbox> asleep = node_->activity({ActivityReport{info.spec.id, "w1", 5, 900, 1}}).asleep;
  run_for(&loop_, 50);
  EXPECT_EQ(state("demo"), S::kSuspended);
  EXPECT_EQ(driver_->resumes, 0);
  ASSERT_EQ(asleep.size(), 1u);
  EXPECT_EQ(asleep[0].id, info.spec.id);
  EXPECT_GT(asleep[0].suspended_at, (*before->result)->opened_at) << "the earlier connection is older";
  // A new connection still wakes it, and is newer than the suspend.
  auto after = open("demo");
  ASSERT_TRUE(run_until(&loop_, [&] { return after->result.has_value(); }));
  ASSERT_TRUE(after->result->ok()) << after->result->message();
  EXPECT_GT((*after->result)->opened_at, asleep[0].suspended_at);
  EXPECT_EQ(state("demo"), S::kRunning);
  EXPECT_TRUE(node_->activity({ActivityReport{info.spec.id, "w1", 5, 0, 1}}).asleep.empty()) << "running: not asleep";
}

TEST_F(NodeTest, RotatingTheTokenRefusesTheOldOneAndRevokesItsConnections) {
  SandboxInfo info = create("demo");
  auto before = open("demo");
  ASSERT_TRUE(before->result.has_value() && before->result->ok());
  EXPECT_TRUE(node_->activity({ActivityReport{info.spec.id, "w1", 0, 0, 1}}).revoked.empty()) << "nothing rotated";
  auto rotated = node_->rotate_token("demo");
  ASSERT_TRUE(rotated.ok()) << rotated.message();
  ASSERT_TRUE(rotated->token.starts_with("sgt_"));
  EXPECT_NE(rotated->token, info.token);
  EXPECT_EQ(node_->check_credential(info.spec.id, info.token), CredentialCheck::kInvalid);
  EXPECT_EQ(node_->check_credential(info.spec.id, rotated->token), CredentialCheck::kAccepted);
  auto answer = node_->activity({ActivityReport{info.spec.id, "w1", 0, 0, 1}});
  ASSERT_EQ(answer.revoked.size(), 1u);
  EXPECT_EQ(answer.revoked[0].id, info.spec.id);
  EXPECT_GT(answer.revoked[0].rotated_at, (*before->result)->opened_at);
  EXPECT_EQ(state("demo"), S::kRunning) << "a rotation changes nothing else";
  EXPECT_EQ(node_->rotate_token("nope").error(), Error::kNotFound);
}

TEST_F(NodeTest, APortExposedAfterCreateIsRoutedStoredAndAnnouncedAndAClosedOneIsRefusedAgain) {
  SandboxInfo info = create("demo");
  std::vector<RouteEvent> events;
  uint64_t sub = node_->subscribe([&](const RouteEvent& e) { events.push_back(e); });
  auto expose = [&](std::string_view ref, int64_t port, ExposeRequest req) {
    std::optional<Result<SandboxInfo>> out;
    node_->expose_port(ref, port, req, [&](Result<SandboxInfo> r) { out.emplace(std::move(r)); });
    EXPECT_TRUE(run_until(&loop_, [&] { return out.has_value(); }));
    return out ? *out : Result<SandboxInfo>(fail(Error::kTimeout, "no answer"));
  };
  EXPECT_EQ(node_->lookup("demo", 3000).error(), Error::kPermissionDenied);

  auto exposed = expose("demo", 3000, ExposeRequest{true, "h2c"});
  ASSERT_TRUE(exposed.ok()) << exposed.message();
  EXPECT_EQ(exposed->spec.exposed_ports, (std::vector<uint16_t>{8080, 3000}));
  EXPECT_EQ(driver_->forwarded, (std::vector<uint16_t>{3000}));
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].reason, "ports");
  EXPECT_EQ(events[0].id, info.spec.id);
  auto access = node_->lookup("demo", 3000);
  ASSERT_TRUE(access.ok()) << access.message();
  EXPECT_TRUE(access->is_public);
  EXPECT_EQ(access->protocol, PortProtocol::kH2c);
  auto opened = open("demo", 3000);
  ASSERT_TRUE(opened->result.has_value() && opened->result->ok());

  // Stored: a restarted node still routes it.
  restart();
  ASSERT_TRUE(node_->reconcile().ok());
  ASSERT_TRUE(node_->lookup("demo", 3000).ok());
  sub = node_->subscribe([&](const RouteEvent& e) { events.push_back(e); });

  // A forward the driver refuses changes nothing; nor does a bad port, past the driver.
  driver_->fail_forward = true;
  auto refused = expose("demo", 3001, {});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("cannot forward port 3001: the fake refuses the forward"), std::string::npos)
      << refused.message();
  EXPECT_EQ(node_->lookup("demo", 3001).error(), Error::kPermissionDenied);
  driver_->fail_forward = false;
  EXPECT_EQ(expose("demo", 0, {}).error(), Error::kInvalidArgument);
  EXPECT_EQ(expose("nope", 3001, {}).error(), Error::kNotFound);
  EXPECT_EQ(events.size(), 1u) << "nothing changed, nothing announced";

  auto closed = node_->close_port("demo", 3000);
  ASSERT_TRUE(closed.ok()) << closed.message();
  EXPECT_EQ(closed->spec.exposed_ports, (std::vector<uint16_t>{8080}));
  EXPECT_EQ(node_->lookup("demo", 3000).error(), Error::kPermissionDenied);
  EXPECT_EQ(driver_->unforwarded, (std::vector<uint16_t>{3000}));
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[1].reason, "ports");
  EXPECT_EQ(node_->close_port("demo", 3000).error(), Error::kNotFound);
  // The proxies hear of it with their next report, and cut the connections to the port opened before.
  auto answer = node_->activity({ActivityReport{info.spec.id, "w1", 0, 0, 1}});
  ASSERT_EQ(answer.closed.size(), 1u);
  EXPECT_EQ(answer.closed[0].id, info.spec.id);
  EXPECT_EQ(answer.closed[0].port, 3000);
  EXPECT_GT(answer.closed[0].closed_at, (*opened->result)->opened_at) << "the connection opened before is cut";

  // Suspended is fine (the driver forwards into the paused instance); changing state is not.
  ASSERT_TRUE(node_->suspend("demo")->started);
  EXPECT_EQ(expose("demo", 3002, {}).error(), Error::kConflict);
  ASSERT_TRUE(wait_state("demo", S::kSuspended));
  EXPECT_TRUE(expose("demo", 3002, {}).ok());
  EXPECT_EQ(state("demo"), S::kSuspended) << "exposing a port wakes nothing";
  node_->unsubscribe(sub);
}

TEST_F(NodeTest, TrafficReportedDuringASuspendDoesNotUndoIt) {
  SandboxInfo info = create("demo");
  driver_->can_cancel = false;
  ASSERT_TRUE(node_->suspend("demo")->started);
  EXPECT_EQ(node_->activity({ActivityReport{info.spec.id, "w1", 0, 7, 1}}).asleep.size(), 1u) << "suspending is asleep";
  ASSERT_TRUE(wait_state("demo", S::kSuspended));
  run_for(&loop_, 50);
  EXPECT_EQ(state("demo"), S::kSuspended);
  EXPECT_EQ(driver_->resumes, 0);
  EXPECT_EQ(driver_->pauses, 1);
}

TEST_F(NodeTest, TrafficKeepsARunningSandboxFromGoingIdle) {
  create("demo", false, 1);
  report_every_300ms_for(1600, ActivityReport{"demo", "w1", 1, 1, 0});
  EXPECT_EQ(state("demo"), S::kRunning) << "bytes every 300 ms, 1 s timeout";
  ASSERT_TRUE(wait_state("demo", S::kSuspended, 3000)) << "idle once the bytes stop";
}

TEST_F(NodeTest, ConnectionsGaugeIsTheSumOfTheLatestPerReporter) {
  SandboxInfo info = create("demo");
  node_->activity({{info.spec.id, "w1", 0, 0, 2}, {info.spec.id, "w2", 0, 0, 3}, {"sb-unknown00000", "w1", 1, 1, 1}});
  EXPECT_EQ(node_->get("demo")->connections, 5u);
  node_->activity({{info.spec.id, "w1", 0, 0, 0}});
  EXPECT_EQ(node_->get("demo")->connections, 3u);
  node_->activity({{info.spec.id, "w2", 0, 0, 1}});
  EXPECT_EQ(node_->get("demo")->connections, 1u);
}

TEST_F(NodeTest, OpenConnectionsHoldASandboxAwake) {
  SandboxInfo info = create("demo", false, 1);
  // An SSH session at a prompt: one open connection, no bytes.
  node_->activity({{info.spec.id, "w1", 0, 0, 1}});
  EXPECT_FALSE(node_->get("demo")->idle_deadline_at_ms.has_value()) << "held: no deadline";
  // Re-reported like a proxy worker does, well within the report TTL (10 x 1000 ms by default).
  report_every_300ms_for(1600, ActivityReport{"demo", "w1", 0, 0, 1});
  EXPECT_EQ(state("demo"), S::kRunning) << "past its 1 s timeout while a connection is open";
  EXPECT_EQ(driver_->pauses, 0);
  // The last connection closes: the idle clock starts from now.
  int64_t closed_at_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::system_clock::now().time_since_epoch()).count();
  node_->activity({{info.spec.id, "w1", 0, 0, 0}});
  auto deadline = node_->get("demo")->idle_deadline_at_ms;
  ASSERT_TRUE(deadline.has_value());
  EXPECT_NEAR(static_cast<double>(*deadline - closed_at_ms), 1000, 100);
  ASSERT_TRUE(wait_state("demo", S::kSuspended));
}

TEST_F(NodeTest, HeldSandboxStaysHeldAcrossASuspendAndResume) {
  SandboxInfo info = create("demo", false, 1);
  node_->activity({{info.spec.id, "w1", 0, 0, 2}});
  suspend_and_wait("demo");
  ASSERT_TRUE(node_->resume("demo").ok());
  ASSERT_TRUE(wait_state("demo", S::kRunning));
  EXPECT_FALSE(node_->get("demo")->idle_deadline_at_ms.has_value()) << "still 2 connections open";
  node_->activity({{info.spec.id, "w1", 0, 0, 0}});
  EXPECT_TRUE(node_->get("demo")->idle_deadline_at_ms.has_value());
}

TEST_F(NodeTest, ConnectionCountsOfAReporterThatWentSilentExpire) {
  // Reports every 50 ms: a count lives 500 ms past its last report.
  node_.reset();
  uv_run(&loop_, UV_RUN_NOWAIT);
  make_node("\n[proxy]\nactivity_report_interval_ms = 50\n");
  SandboxInfo info = create("demo", false, 1);
  node_->activity({{info.spec.id, "crashed-proxy", 0, 0, 3}, {info.spec.id, "live-proxy", 0, 0, 1}});
  EXPECT_EQ(node_->get("demo")->connections, 4u);
  node_->activity({{info.spec.id, "live-proxy", 0, 0, 0}});
  run_for(&loop_, 300);
  EXPECT_EQ(node_->get("demo")->connections, 3u) << "not expired yet";
  EXPECT_FALSE(node_->get("demo")->idle_deadline_at_ms.has_value());
  ASSERT_TRUE(run_until(&loop_, [&] { return node_->get("demo")->connections == 0; }, 1000));
  EXPECT_TRUE(node_->get("demo")->idle_deadline_at_ms.has_value()) << "the expiry releases the hold";
  EXPECT_EQ(state("demo"), S::kRunning);
  ASSERT_TRUE(wait_state("demo", S::kSuspended, 2000)) << "and the idle policy applies again";
}

TEST_F(NodeTest, CreateAnswersWithATokenOnceAndKeepsItsDigest) {
  SandboxInfo info = create("demo");
  ASSERT_TRUE(info.token.starts_with("sgt_")) << info.token;
  EXPECT_EQ(info.spec.token_sha256, token_digest(info.token));
  EXPECT_TRUE(node_->get("demo")->token.empty());
  for (const SandboxInfo& listed : node_->list()) EXPECT_TRUE(listed.token.empty());
  EXPECT_EQ(node_->check_credential(info.spec.id, info.token), CredentialCheck::kAccepted);
  EXPECT_EQ(node_->check_credential(info.spec.id, std::nullopt), CredentialCheck::kMissing);
  EXPECT_EQ(node_->check_credential(info.spec.id, std::string()), CredentialCheck::kMissing);
  EXPECT_EQ(node_->check_credential(info.spec.id, info.token + "x"), CredentialCheck::kInvalid);
  SandboxInfo other = create("other");
  EXPECT_NE(other.token, info.token);
  EXPECT_EQ(node_->check_credential(info.spec.id, other.token), CredentialCheck::kInvalid);
  // The digest survives a restart; the token itself was never stored.
  restart();
  ASSERT_TRUE(node_->reconcile().ok());
  EXPECT_EQ(node_->check_credential(info.spec.id, info.token), CredentialCheck::kAccepted);
}

TEST_F(NodeTest, PortPoliciesAndLookup) {
  CreateRequest r = request("demo");
  r.ports = {{22, true, "tcp"}, {50051, std::nullopt, "h2c"}, {3000, std::nullopt, std::nullopt}};
  auto created = create_request(r);
  ASSERT_TRUE(created.ok()) << created.message();
  EXPECT_EQ(created->spec.exposed_ports, (std::vector<uint16_t>{8080, 22, 50051, 3000}));
  EXPECT_EQ(created->spec.agent_port, 9501);
  auto expect_access = [&](uint16_t port, PortProtocol protocol, bool is_public) {
    auto a = node_->lookup("demo", port);
    ASSERT_TRUE(a.ok()) << port << ": " << a.message();
    EXPECT_EQ(a->id, created->spec.id);
    EXPECT_EQ(a->name, "demo");
    EXPECT_EQ(a->protocol, protocol) << port;
    EXPECT_EQ(a->is_public, is_public) << port;
  };
  expect_access(8080, PortProtocol::kHttp1, false);
  expect_access(22, PortProtocol::kTcp, true);
  expect_access(50051, PortProtocol::kH2c, false);
  expect_access(3000, PortProtocol::kHttp1, false);
  expect_access(9501, PortProtocol::kH2c, false);
  EXPECT_EQ(node_->lookup("demo", 9999).error(), Error::kPermissionDenied);
  EXPECT_EQ(node_->lookup("nope", 22).error(), Error::kNotFound);
  // The agent port opens like an exposed one.
  auto agent = open("demo", 9501);
  ASSERT_TRUE(agent->result.has_value() && agent->result->ok());
  EXPECT_EQ(agent->result->value().protocol, PortProtocol::kH2c);

  CreateRequest everything = request("open");
  everything.allow_unauthenticated_access = true;
  ASSERT_TRUE(create_request(everything).ok());
  EXPECT_TRUE(node_->lookup("open", 8080)->is_public);
  // allow_unauthenticated_access publishes exposed ports only: the agent runs commands as root.
  EXPECT_FALSE(node_->lookup("open", 9501)->is_public);
  EXPECT_EQ(node_->lookup("open", 9501)->protocol, PortProtocol::kH2c);
}

TEST_F(NodeTest, PortPoliciesAreValidated) {
  auto rejects = [&](CreateRequest r, const std::string& contains) {
    auto out = create_request(r);
    ASSERT_FALSE(out.ok()) << contains;
    EXPECT_EQ(out.error(), Error::kInvalidArgument);
    EXPECT_NE(out.message().find(contains), std::string::npos) << out.message();
  };
  CreateRequest r = request("x");
  r.ports = {{8080, true, "tcp"}};
  rejects(r, "8080 is listed twice");
  r.ports = {{22, true, "udp"}};
  rejects(r, "'udp' is not one of http1, h2c, tcp");
  r.ports = {{65536, true, "tcp"}};
  rejects(r, "65536 is not a TCP port");
  r.ports = {{9501, false, std::nullopt}};
  rejects(r, "agent's port");
  r.ports.clear();
  r.exposed_ports.clear();
  for (int64_t p = 1; p <= 65; ++p) r.exposed_ports.push_back(p);
  rejects(r, "at most 64 ports");
  r.exposed_ports.pop_back();
  EXPECT_TRUE(create_request(r).ok()) << "64 is the limit, not 63";
}

TEST_F(NodeTest, OperatorTokenOpensEverySandbox) {
  std::string token_path = dir_.path() + "/operator.token";
  std::ofstream(token_path) << "  op-secret-0123456789\n\n";
  std::filesystem::permissions(token_path, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  auto cfg = load_config_string("operator_token_file = \"" + token_path + "\"\n[node]\nstate_dir = \"" +
                                    dir_.path() + "\"\n",
                                "test.toml");
  ASSERT_TRUE(cfg.ok()) << cfg.message();
  config_->swap(*cfg);
  ASSERT_TRUE(node_->load_operator_token(**cfg).ok());
  SandboxInfo info = create("demo");
  EXPECT_EQ(node_->check_credential(info.spec.id, std::string("op-secret-0123456789")), CredentialCheck::kAccepted);
  EXPECT_EQ(node_->check_credential(info.spec.id, std::string("op-secret")), CredentialCheck::kInvalid);
  EXPECT_EQ(node_->check_credential(info.spec.id, std::string("  op-secret-0123456789\n")), CredentialCheck::kInvalid);

  // A configured file that is empty, missing or oversized keeps the node from starting (main.cc stops).
  for (const std::string& content : {std::string(" \n\t"), std::string(5000, 'a')}) {
    std::ofstream(token_path, std::ios::trunc) << content;
    restart();
    auto s = node_->load_operator_token(**cfg);
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("operator_token_file"), std::string::npos) << s.message();
  }
  std::filesystem::remove(token_path);
  restart();
  EXPECT_FALSE(node_->load_operator_token(**cfg).ok());
}

TEST_F(NodeTest, OperatorTokenFileMustBeOwnerOnly) {
  std::string token_path = dir_.path() + "/operator.token";
  std::ofstream(token_path) << "op-secret-0123456789\n";
  auto cfg = load_config_string("operator_token_file = \"" + token_path + "\"\n[node]\nstate_dir = \"" +
                                    dir_.path() + "\"\n",
                                "test.toml");
  ASSERT_TRUE(cfg.ok()) << cfg.message();
  for (mode_t mode : {0644, 0640, 0604, 0620, 0602}) {
    ASSERT_EQ(::chmod(token_path.c_str(), mode), 0);
    auto s = node_->load_operator_token(**cfg);
    ASSERT_FALSE(s.ok()) << std::oct << mode;
    EXPECT_EQ(s.error(), Error::kPermissionDenied);
    EXPECT_NE(s.message().find(token_path), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("chmod 600"), std::string::npos) << s.message();
  }
  for (mode_t mode : {0600, 0400}) {
    ASSERT_EQ(::chmod(token_path.c_str(), mode), 0);
    EXPECT_TRUE(node_->load_operator_token(**cfg).ok()) << std::oct << mode;
  }
  // Not a regular file (a directory, say) is refused too.
  auto dir_cfg = load_config_string("operator_token_file = \"" + dir_.path() + "\"\n", "test.toml");
  ASSERT_TRUE(dir_cfg.ok());
  EXPECT_FALSE(node_->load_operator_token(**dir_cfg).ok());
}

TEST_F(NodeTest, ReloadingTheOperatorTokenReplacesTheOldOne) {
  std::string token_path = dir_.path() + "/operator.token";
  auto write_token = [&](const std::string& token) {
    std::ofstream(token_path, std::ios::trunc) << token << "\n";
    std::filesystem::permissions(token_path, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  };
  write_token("op-old-0123456789");
  auto cfg = load_config_string("operator_token_file = \"" + token_path + "\"\n[node]\nstate_dir = \"" +
                                    dir_.path() + "\"\n",
                                "test.toml");
  ASSERT_TRUE(cfg.ok()) << cfg.message();
  ASSERT_TRUE(node_->load_operator_token(**cfg).ok());
  EXPECT_EQ(node_->check_operator_token(std::string("op-old-0123456789")), CredentialCheck::kAccepted);

  write_token("op-new-9876543210");
  ASSERT_TRUE(node_->load_operator_token(**cfg).ok());
  EXPECT_EQ(node_->check_operator_token(std::string("op-new-9876543210")), CredentialCheck::kAccepted);
  EXPECT_EQ(node_->check_operator_token(std::string("op-old-0123456789")), CredentialCheck::kInvalid);
  EXPECT_EQ(node_->check_operator_token(std::nullopt), CredentialCheck::kMissing);

  // A file that became unusable keeps the token the node has.
  ASSERT_EQ(::chmod(token_path.c_str(), 0644), 0);
  EXPECT_FALSE(node_->load_operator_token(**cfg).ok());
  EXPECT_EQ(node_->check_operator_token(std::string("op-new-9876543210")), CredentialCheck::kAccepted);
  // A sandbox's own token is not the operator token.
  SandboxInfo info = create("demo");
  EXPECT_EQ(node_->check_operator_token(info.token), CredentialCheck::kInvalid);
}

TEST_F(NodeTest, ExitWatch) {
  SandboxInfo named = create("named");
  SandboxInfo ephemeral = create(std::nullopt, true);
  driver_->exit(named.spec.id);
  EXPECT_EQ(state("named"), S::kFailed);
  EXPECT_NE(node_->get("named")->state_reason.find("exited"), std::string::npos);
  driver_->exit(ephemeral.spec.id);
  ASSERT_TRUE(run_until(&loop_, [&] { return !node_->get(ephemeral.spec.id).ok(); }));
  EXPECT_EQ(driver_->terminates, 1) << "the ephemeral sandbox's leftovers are released";
}

TEST_F(NodeTest, ExitWhileWakingFailsTheWaiters) {
  SandboxInfo info = create("demo");
  suspend_and_wait("demo");
  driver_->op_delay_ms = 200;
  auto o = open("demo");
  driver_->exit(info.spec.id);
  ASSERT_TRUE(o->result.has_value());
  EXPECT_EQ(o->result->error(), Error::kUnavailable);
  run_for(&loop_, 250);  // the late resume completion is ignored
  EXPECT_EQ(state("demo"), S::kFailed);
}

TEST_F(NodeTest, DeleteTerminatesAndForgets) {
  SandboxInfo info = create("demo");
  std::optional<Result<SandboxInfo>> first, second;
  node_->remove("demo", [&](Result<SandboxInfo> r) { first.emplace(std::move(r)); });
  node_->remove(info.spec.id, [&](Result<SandboxInfo> r) { second.emplace(std::move(r)); });
  ASSERT_TRUE(run_until(&loop_, [&] { return first && second; }));
  ASSERT_TRUE(first->ok());
  ASSERT_TRUE(second->ok());
  EXPECT_EQ(first->value().state, S::kTerminated);
  EXPECT_EQ(driver_->terminates, 1);
  EXPECT_EQ(driver_->unwatches, 1);
  EXPECT_EQ(node_->get("demo").error(), Error::kNotFound);
  EXPECT_TRUE(node_->list().empty());
  EXPECT_FALSE(std::filesystem::exists(dir_.path() + "/sandboxes/" + info.spec.id));
  EXPECT_TRUE((*Store::open(dir_.path() + "/node.db"))->load_live()->empty());
  create("demo");  // the name is free again
  EXPECT_EQ(remove("nope")->error(), Error::kNotFound);
}

TEST_F(NodeTest, DeleteFailsOpensWaitingForAWake) {
  create("demo");
  suspend_and_wait("demo");
  driver_->op_delay_ms = 200;
  auto o = open("demo");
  node_->remove("demo", [](Result<SandboxInfo>) {});
  ASSERT_TRUE(o->result.has_value());
  EXPECT_EQ(o->result->error(), Error::kNotFound);
  ASSERT_TRUE(run_until(&loop_, [&] { return !node_->get("demo").ok(); }));
}

TEST_F(NodeTest, FailedSuspendRollsBack) {
  create("demo");
  driver_->fail_pause = true;
  driver_->can_cancel = false;
  ASSERT_TRUE(node_->suspend("demo")->started);
  auto o = open("demo");
  ASSERT_TRUE(wait_state("demo", S::kRunning));
  EXPECT_NE(node_->get("demo")->state_reason.find("suspend failed"), std::string::npos);
  ASSERT_TRUE(o->result.has_value());
  EXPECT_TRUE(o->result->ok()) << "the waiting open is served by the still-running sandbox";
  EXPECT_TRUE(node_->get("demo")->idle_deadline_at_ms.has_value());
}

TEST_F(NodeTest, FailedResumeFailsTheSandboxButNotTheNode) {
  create("demo");
  suspend_and_wait("demo");
  driver_->fail_resume = true;
  auto o = open("demo");
  ASSERT_TRUE(run_until(&loop_, [&] { return o->result.has_value(); }));
  EXPECT_EQ(o->result->error(), Error::kUnavailable);
  EXPECT_EQ(state("demo"), S::kFailed);
  EXPECT_NE(node_->get("demo")->state_reason.find("resume failed"), std::string::npos);
  driver_->fail_resume = false;
  create("other");
  EXPECT_TRUE(open("other")->result->ok());
  ASSERT_TRUE(remove("demo")->ok()) << "a failed sandbox can still be deleted";
}

TEST_F(NodeTest, FailedTerminateLeavesAFailedSandbox) {
  create("demo");
  driver_->fail_terminate = true;
  auto r = remove("demo");
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->error(), Error::kIo);
  EXPECT_EQ(state("demo"), S::kFailed);
  EXPECT_NE(node_->get("demo")->state_reason.find("terminate failed"), std::string::npos);
  driver_->fail_terminate = false;
  EXPECT_TRUE(remove("demo")->ok());
}

TEST_F(NodeTest, FailedStartLeavesNothingBehind) {
  driver_->fail_start = true;
  auto info = create_request(request("demo"));
  ASSERT_FALSE(info.ok());
  EXPECT_NE(info.message().find("exec failed"), std::string::npos);
  EXPECT_TRUE(node_->list().empty());
  EXPECT_TRUE((*Store::open(dir_.path() + "/node.db"))->load_live()->empty());
  driver_->fail_start = false;
  create("demo");
}

TEST_F(NodeTest, NamesAreUniqueAmongLiveSandboxes) {
  SandboxInfo first = create("demo");
  auto dup = create_request(request("demo"));
  ASSERT_FALSE(dup.ok());
  EXPECT_EQ(dup.error(), Error::kAlreadyExists);
  EXPECT_NE(dup.message().find(first.spec.id), std::string::npos);
}

TEST_F(NodeTest, MaxSandboxes) {
  make_node("max_sandboxes = 2\n");
  create("a");
  create("b");
  auto third = create_request(request("c"));
  ASSERT_FALSE(third.ok());
  EXPECT_EQ(third.error(), Error::kLimitExceeded);
  // A reload that raises the limit applies to the next request.
  auto raised = load_config_string("[node]\nstate_dir = \"" + dir_.path() + "\"\nmax_sandboxes = 3\n", "t");
  config_->swap(*raised);
  create("c");
}

// Every sandbox reserves its memory_mb and cpus while it may run, suspended included; a create beyond
// node.max_memory_mb or node.max_cpus is a 429 naming the key, and a removal or a failure gives the room back.
TEST_F(NodeTest, MaxMemoryAndCpusBoundWhatTheSandboxesReserve) {
  make_node("max_memory_mb = 1024\nmax_cpus = 2\n");
  CreateRequest big = request("big");
  big.memory_mb = 768;
  big.cpus = 0.5;
  create_request(big).value();
  CreateRequest more = request("more");
  more.memory_mb = 512;
  auto refused = create_request(more);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error(), Error::kLimitExceeded);
  EXPECT_NE(refused.message().find("node.max_memory_mb"), std::string::npos) << refused.message();
  ASSERT_TRUE(node_->suspend("big").ok());  // a suspended sandbox keeps its reservation: it may wake at any moment
  ASSERT_TRUE(run_until(&loop_, [&] { return state("big") == S::kSuspended; }));
  EXPECT_EQ(create_request(more).error(), Error::kLimitExceeded);
  more.memory_mb = 256;
  more.cpus = 1.75;
  auto cpus = create_request(more);
  ASSERT_FALSE(cpus.ok());
  EXPECT_NE(cpus.message().find("node.max_cpus"), std::string::npos) << cpus.message();
  more.cpus = 1.5;
  create_request(more).value();
  EXPECT_EQ(node_->reservations()->memory_mb.load(), 1024u);
  EXPECT_EQ(node_->reservations()->millicpus.load(), 2000u);
  ASSERT_TRUE(remove("big")->ok());
  EXPECT_EQ(node_->reservations()->memory_mb.load(), 256u);
  CreateRequest after = request("after");
  after.memory_mb = 768;
  after.cpus = 0.5;
  SandboxInfo last = create_request(after).value();
  // A sandbox that failed cannot run again: its room goes back before it is removed.
  driver_->exit(last.spec.id);
  ASSERT_EQ(state("after"), S::kFailed);
  EXPECT_EQ(node_->reservations()->memory_mb.load(), 256u);
  EXPECT_EQ(node_->reservations()->millicpus.load(), 1500u);
}

// node.default_disk_mb is the default of drivers that enforce disk_mb; the create's own value wins.
TEST_F(NodeTest, DefaultDiskLimitAppliesWhereTheDriverEnforcesIt) {
  make_node("default_disk_mb = 64\n");
  EXPECT_EQ(create("a").spec.disk_mb, 0u);  // this driver does not enforce it: no limit is promised
  driver_->limits_disk = true;
  EXPECT_EQ(create("b").spec.disk_mb, 64u);
  CreateRequest own = request("c");
  own.disk_mb = 32;
  auto c = create_request(own);
  ASSERT_TRUE(c.ok()) << c.message();
  EXPECT_EQ(c->spec.disk_mb, 32u);
  CreateRequest none = request("d");
  none.disk_mb = 0;
  auto d = create_request(none);
  ASSERT_TRUE(d.ok()) << d.message();
  EXPECT_EQ(d->spec.disk_mb, 0u);
}

TEST_F(NodeTest, RejectsInvalidRequests) {
  struct Case {
    const char* what;
    std::function<void(CreateRequest&)> mutate;
    const char* message_contains;
  };
  const double kNan = std::numeric_limits<double>::quiet_NaN();
  const double kInf = std::numeric_limits<double>::infinity();
  const Case cases[] = {
      {"bad name", [](CreateRequest& r) { r.name = "Bad_Name"; }, "lowercase"},
      {"id-like name", [](CreateRequest& r) { r.name = "sb-0123456789ab"; }, "sandbox id"},
      {"empty command", [](CreateRequest& r) { r.command.clear(); }, "command"},
      {"empty argv[0]", [](CreateRequest& r) { r.command = {""}; }, "command[0]"},
      {"empty arg", [](CreateRequest& r) { r.command = {"ls", ""}; }, "command[1]"},
      {"NUL in arg", [](CreateRequest& r) { r.command = {"ls", std::string("a\0b", 3)}; }, "NUL"},
      {"env key digit", [](CreateRequest& r) { r.env = {{"1A", "x"}}; }, "1A"},
      {"env key dash", [](CreateRequest& r) { r.env = {{"A-B", "x"}}; }, "A-B"},
      {"env key =", [](CreateRequest& r) { r.env = {{"A=B", "x"}}; }, "A=B"},
      {"env key empty", [](CreateRequest& r) { r.env = {{"", "x"}}; }, "env"},
      {"env value NUL", [](CreateRequest& r) { r.env = {{"A", std::string("x\0y", 3)}}; }, "NUL"},
      {"cwd relative", [](CreateRequest& r) { r.cwd = "tmp"; }, "absolute"},
      {"cwd empty", [](CreateRequest& r) { r.cwd = ""; }, "absolute"},
      {"cwd NUL", [](CreateRequest& r) { r.cwd = std::string("/a\0b", 4); }, "NUL"},
      {"port 0", [](CreateRequest& r) { r.exposed_ports = {0}; }, "1-65535"},
      {"port 65536", [](CreateRequest& r) { r.exposed_ports = {65536}; }, "1-65535"},
      {"port negative", [](CreateRequest& r) { r.exposed_ports = {-80}; }, "1-65535"},
      {"port twice", [](CreateRequest& r) { r.exposed_ports = {80, 81, 80}; }, "twice"},
      {"timeout 0", [](CreateRequest& r) { r.timeout_secs = 0; }, "timeout_secs"},
      {"timeout over max", [](CreateRequest& r) { r.timeout_secs = 7 * 24 * 3600 + 1; }, "timeout_secs"},
      {"timeout huge", [](CreateRequest& r) { r.timeout_secs = std::numeric_limits<int64_t>::max(); }, "timeout"},
      {"memory 15", [](CreateRequest& r) { r.memory_mb = 15; }, "memory_mb"},
      {"memory over", [](CreateRequest& r) { r.memory_mb = 1048577; }, "memory_mb"},
      {"pids 7", [](CreateRequest& r) { r.pids_max = 7; }, "pids_max: must be between 8 and 4194304"},
      {"pids over", [](CreateRequest& r) { r.pids_max = 4194305; }, "pids_max"},
      {"image empty", [](CreateRequest& r) { r.image = ""; }, "image"},
      {"disk 15", [](CreateRequest& r) { r.disk_mb = 15; }, "disk_mb: must be 0 (no limit) or between 16"},
      {"disk negative", [](CreateRequest& r) { r.disk_mb = -1; }, "disk_mb"},
      {"cpus 0", [](CreateRequest& r) { r.cpus = 0; }, "cpus"},
      {"cpus negative", [](CreateRequest& r) { r.cpus = -1; }, "cpus"},
      {"cpus over", [](CreateRequest& r) { r.cpus = 1024.5; }, "cpus"},
      {"cpus NaN", [kNan](CreateRequest& r) { r.cpus = kNan; }, "cpus"},
      {"cpus inf", [kInf](CreateRequest& r) { r.cpus = kInf; }, "cpus"},
  };
  for (const Case& c : cases) {
    CreateRequest r = request("demo");
    c.mutate(r);
    auto info = create_request(r);
    ASSERT_FALSE(info.ok()) << c.what;
    EXPECT_EQ(info.error(), Error::kInvalidArgument) << c.what;
    EXPECT_NE(info.message().find(c.message_contains), std::string::npos) << c.what << ": " << info.message();
  }
  EXPECT_EQ(driver_->starts, 0);
  // The edges themselves are fine.
  CreateRequest edge = request("edge");
  edge.exposed_ports = {1, 65535};
  edge.timeout_secs = 1;
  edge.memory_mb = 16;
  edge.cpus = 1024;
  edge.env = {{"_A1", ""}};
  EXPECT_TRUE(create_request(edge).ok());
}

TEST_F(NodeTest, ReconcileAfterRestart) {
  SandboxInfo running = create("running");
  SandboxInfo suspended = create("suspended");
  SandboxInfo ephemeral = create(std::nullopt, true);
  SandboxInfo died = create("died");
  SandboxInfo died_ephemeral = create(std::nullopt, true);
  SandboxInfo half_suspended = create("half-suspended");
  SandboxInfo half_resumed = create("half-resumed");
  SandboxInfo failed = create("failed");
  suspend_and_wait("suspended");
  suspend_and_wait("half-resumed");
  driver_->exit(failed.spec.id);
  // Crash while a freeze and a thaw are in flight: the store says suspending / resuming.
  driver_->op_delay_ms = 10'000;
  ASSERT_TRUE(node_->suspend("half-suspended")->started);
  ASSERT_TRUE(node_->resume("half-resumed")->started);
  driver_->instances[died.spec.id].alive = false;
  driver_->instances[died_ephemeral.spec.id].alive = false;

  restart();
  driver_->op_delay_ms = 5;
  ASSERT_TRUE(node_->reconcile().ok());
  EXPECT_EQ(state("running"), S::kRunning);
  EXPECT_TRUE(node_->get("running")->idle_deadline_at_ms.has_value()) << "idle clock restarted";
  EXPECT_EQ(state("suspended"), S::kSuspended);
  EXPECT_EQ(state(ephemeral.spec.id), S::kRunning);
  EXPECT_EQ(state("died"), S::kFailed);
  EXPECT_EQ(node_->get("died")->state_reason, "not running after node restart");
  EXPECT_EQ(state("half-suspended"), S::kRunning) << "the freeze never happened";
  EXPECT_EQ(state("failed"), S::kFailed);
  ASSERT_TRUE(wait_state("half-resumed", S::kRunning)) << "the interrupted resume is finished";
  ASSERT_TRUE(run_until(&loop_, [&] { return !node_->get(died_ephemeral.spec.id).ok(); }));
  EXPECT_EQ(driver_->resumes, 1);
  // Watched again: running, suspended, ephemeral, half-suspended, half-resumed.
  EXPECT_EQ(driver_->watches, 5);
  driver_->exit(running.spec.id);
  EXPECT_EQ(state("running"), S::kFailed);
  // The name index was rebuilt: names are still taken.
  EXPECT_EQ(create_request(request("suspended")).error(), Error::kAlreadyExists);
}

TEST_F(NodeTest, ReconcileFinishesAFreezeThatCompletedBeforeTheCrash) {
  SandboxInfo info = create("demo");
  driver_->op_delay_ms = 10'000;
  ASSERT_TRUE(node_->suspend("demo")->started);
  driver_->instances[info.spec.id].paused = true;  // the freeze took effect; the node died before noting it
  restart();
  ASSERT_TRUE(node_->reconcile().ok());
  EXPECT_EQ(state("demo"), S::kSuspended);
  EXPECT_EQ(node_->get("demo")->state_reason, "suspend completed before node restart");
}

// Running on record, paused in fact: a checkpoint's freeze the node died in (a suspend records `suspending`
// first). The source must run on, so it is resumed, not adopted as suspended.
TEST_F(NodeTest, ReconcileResumesASandboxACheckpointLeftPaused) {
  SandboxInfo info = create("demo");
  driver_->instances[info.spec.id].paused = true;
  restart();
  ASSERT_TRUE(node_->reconcile().ok());
  ASSERT_TRUE(wait_state("demo", S::kRunning));
  EXPECT_EQ(driver_->resumes, 1);
  EXPECT_FALSE(driver_->instances[info.spec.id].paused);
  EXPECT_EQ(node_->get("demo")->tier, SuspendTier::kNone);
  EXPECT_TRUE(node_->get("demo")->idle_deadline_at_ms.has_value()) << "its idle clock runs again";
}

TEST_F(NodeTest, ShutdownKeepLeavesSandboxesRunning) {
  SandboxInfo info = create("demo");
  suspend_and_wait("demo");
  driver_->op_delay_ms = 10'000;
  auto o = open("demo");
  bool done = false;
  node_->shutdown([&] { done = true; });
  EXPECT_FALSE(done) << "completion is delivered from the loop";
  ASSERT_TRUE(run_until(&loop_, [&] { return done; }));
  EXPECT_EQ(o->result->error(), Error::kUnavailable);
  EXPECT_EQ(driver_->terminates, 0);
  EXPECT_TRUE(driver_->instances[info.spec.id].alive);
  EXPECT_EQ(driver_->unwatches, 1);
  EXPECT_EQ(create_request(request("late")).error(), Error::kUnavailable);
  EXPECT_EQ((*Store::open(dir_.path() + "/node.db"))->load_live()->size(), 1u);
}

TEST_F(NodeTest, ShutdownTerminateTerminatesEverything) {
  make_node("on_shutdown = \"terminate\"\n");
  create("a");
  create("b");
  create(std::nullopt, true);
  suspend_and_wait("b");
  bool done = false;
  node_->shutdown([&] { done = true; });
  ASSERT_TRUE(run_until(&loop_, [&] { return done; }));
  EXPECT_EQ(driver_->terminates, 3);
  EXPECT_TRUE(node_->list().empty());
  EXPECT_TRUE((*Store::open(dir_.path() + "/node.db"))->load_live()->empty());
}

// ---- two-tier idle policy ----

TEST_F(NodeTest, IdleSandboxPausesThenHibernates) {
  CreateRequest r = request("tiered", false, 1);
  r.hibernate_after_secs = 1;
  auto created = create_request(r);
  ASSERT_TRUE(created.ok()) << created.message();
  EXPECT_EQ(created->next_transition, "suspend");
  EXPECT_EQ(created->tier, SuspendTier::kNone);
  ASSERT_TRUE(wait_state("tiered", S::kSuspended));
  SandboxInfo paused = *node_->get("tiered");
  EXPECT_EQ(paused.tier, SuspendTier::kMemory);
  EXPECT_EQ(paused.next_transition, "hibernate");
  ASSERT_TRUE(paused.next_transition_at_ms.has_value());
  EXPECT_FALSE(paused.idle_deadline_at_ms.has_value());
  ASSERT_TRUE(run_until(&loop_, [&] { return hibernated("tiered"); }, 3000));
  SandboxInfo hibernated = *node_->get("tiered");
  EXPECT_EQ(hibernated.state, S::kSuspended);
  EXPECT_EQ(hibernated.state_reason, "suspended in memory for 1 s");
  EXPECT_TRUE(hibernated.next_transition.empty()) << "nothing after the disk tier";
  EXPECT_EQ(hibernated.runtime.pid, 0);
  EXPECT_EQ(driver_->pauses, 1);
  EXPECT_EQ(driver_->hibernates, 1);
  auto rows = (*Store::open(dir_.path() + "/node.db"))->load_live();
  ASSERT_EQ(rows->size(), 1u);
  EXPECT_EQ((*rows)[0].tier, SuspendTier::kDisk);
  EXPECT_EQ((*rows)[0].runtime.driver_data.count("state_file"), 1u) << "the driver's data is persisted";
}

// A restore the node was killed in after its instance ran: the driver finds that instance in place of the
// recorded one (none) and hands its runtime over. The record takes it before anything else, and the sandbox
// is running, not hibernated (its saved state is behind the guest now).
TEST_F(NodeTest, ReconcileAdoptsTheInstanceAnInterruptedRestoreLeftRunning) {
  CreateRequest r = request("tiered", false, 1);
  r.hibernate_after_secs = 1;
  ASSERT_TRUE(create_request(r).ok());
  ASSERT_TRUE(run_until(&loop_, [&] { return hibernated("tiered"); }, 4000));
  const std::string id = node_->get("tiered")->spec.id;
  RuntimeInfo found = node_->get("tiered")->runtime;
  restart();
  found.pid = 4242;
  found.start_time_ticks = 77;
  found.driver_data.erase("state_file");
  driver_->instances[id] = FakeDriver::Instance{.alive = true, .paused = false, .hibernated = false,
                                                .found_runtime = found, .on_exit = nullptr};
  ASSERT_TRUE(node_->reconcile().ok());
  SandboxInfo info = *node_->get("tiered");
  EXPECT_EQ(info.state, S::kRunning);
  EXPECT_EQ(info.tier, SuspendTier::kNone);
  EXPECT_EQ(info.runtime.pid, 4242);
  auto rows = (*Store::open(dir_.path() + "/node.db"))->load_live();
  ASSERT_EQ(rows->size(), 1u);
  EXPECT_EQ((*rows)[0].runtime.pid, 4242) << "persisted: a node killed again finds it by the record";
  EXPECT_EQ((*rows)[0].runtime.start_time_ticks, 77u);
  EXPECT_EQ((*rows)[0].runtime.driver_data.count("state_file"), 0u);
}

TEST_F(NodeTest, OpenRestoresAHibernatedSandbox) {
  CreateRequest r = request("tiered", false, 1);
  r.hibernate_after_secs = 1;
  ASSERT_TRUE(create_request(r).ok());
  ASSERT_TRUE(run_until(&loop_, [&] { return hibernated("tiered"); }, 4000));
  int watches_before = driver_->watches;
  auto o = open("tiered");
  EXPECT_EQ(state("tiered"), S::kResuming);
  EXPECT_EQ(node_->get("tiered")->tier, SuspendTier::kDisk) << "resuming from the disk tier";
  ASSERT_TRUE(run_until(&loop_, [&] { return o->result.has_value(); }));
  ASSERT_TRUE(o->result->ok()) << o->result->message();
  EXPECT_TRUE(o->result->value().woke);
  EXPECT_EQ(driver_->restores, 1);
  EXPECT_EQ(driver_->resumes, 0);
  EXPECT_EQ(driver_->restored_from.driver_data.count("state_file"), 1u) << "restored from what hibernate saved";
  SandboxInfo info = *node_->get("tiered");
  EXPECT_EQ(info.state, S::kRunning);
  EXPECT_EQ(info.tier, SuspendTier::kNone);
  EXPECT_GT(info.runtime.pid, 0);
  EXPECT_EQ(driver_->watches, watches_before + 1) << "the restored instance is watched";
  EXPECT_EQ(info.next_transition, "suspend");
}

TEST_F(NodeTest, OpenDuringHibernationCancelsItAndResumesFromMemory) {
  CreateRequest r = request("tiered", false, 1);
  r.hibernate_after_secs = 1;
  ASSERT_TRUE(create_request(r).ok());
  driver_->hibernate_delay_ms = 3000;
  ASSERT_TRUE(run_until(&loop_, [&] { return driver_->hibernates == 1; }, 4000));
  ASSERT_EQ(state("tiered"), S::kSuspending);
  EXPECT_EQ(node_->get("tiered")->tier, SuspendTier::kDisk) << "suspending towards the disk tier";
  auto o = open("tiered");
  ASSERT_TRUE(run_until(&loop_, [&] { return o->result.has_value(); }, 500)) << "waited for the full hibernation";
  ASSERT_TRUE(o->result->ok()) << o->result->message();
  EXPECT_EQ(driver_->cancels, 1);
  EXPECT_EQ(driver_->resumes, 1) << "back from memory: the shorter way";
  EXPECT_EQ(driver_->restores, 0);
  EXPECT_EQ(state("tiered"), S::kRunning);
}

TEST_F(NodeTest, OpenDuringAnUncancellableHibernationRestoresAfterIt) {
  CreateRequest r = request("tiered", false, 1);
  r.hibernate_after_secs = 1;
  ASSERT_TRUE(create_request(r).ok());
  driver_->hibernate_delay_ms = 200;
  driver_->can_cancel = false;
  ASSERT_TRUE(run_until(&loop_, [&] { return driver_->hibernates == 1; }, 4000));
  auto o = open("tiered");
  ASSERT_TRUE(run_until(&loop_, [&] { return o->result.has_value(); }));
  ASSERT_TRUE(o->result->ok()) << o->result->message();
  EXPECT_EQ(driver_->restores, 1);
  EXPECT_EQ(driver_->resumes, 0);
  EXPECT_EQ(state("tiered"), S::kRunning);
}

TEST_F(NodeTest, FailedHibernationStaysSuspendedInMemory) {
  CreateRequest r = request("tiered", false, 1);
  r.hibernate_after_secs = 1;
  SandboxInfo info = *create_request(r);
  driver_->fail_hibernate = true;
  ASSERT_TRUE(run_until(&loop_, [&] { return driver_->hibernates == 1 && state("tiered") == S::kSuspended; }, 4000));
  SandboxInfo after = *node_->get("tiered");
  EXPECT_EQ(after.tier, SuspendTier::kMemory);
  EXPECT_NE(after.state_reason.find("hibernate failed, still suspended in memory: disk full"), std::string::npos)
      << after.state_reason;
  EXPECT_EQ(after.next_transition, "hibernate") << "tried again after another hibernate_after_secs";
  EXPECT_TRUE(std::filesystem::is_directory(dir_.path() + "/sandboxes/" + info.spec.id)) << "no data deleted";
  auto o = open("tiered");
  ASSERT_TRUE(run_until(&loop_, [&] { return o->result.has_value(); }));
  EXPECT_TRUE(o->result->ok());
  EXPECT_EQ(driver_->resumes, 1);
}

TEST_F(NodeTest, FailedRestoreFailsTheSandboxButKeepsItsData) {
  CreateRequest r = request("tiered", false, 1);
  r.hibernate_after_secs = 1;
  SandboxInfo info = *create_request(r);
  ASSERT_TRUE(run_until(&loop_, [&] { return hibernated("tiered"); }, 4000));
  driver_->fail_restore = true;
  auto o = open("tiered");
  ASSERT_TRUE(run_until(&loop_, [&] { return o->result.has_value(); }));
  EXPECT_EQ(o->result->error(), Error::kUnavailable);
  EXPECT_EQ(state("tiered"), S::kFailed);
  EXPECT_NE(node_->get("tiered")->state_reason.find("restore from disk failed: state file truncated"),
            std::string::npos);
  EXPECT_TRUE(std::filesystem::is_directory(dir_.path() + "/sandboxes/" + info.spec.id)) << "no data deleted";
  create("other");
  EXPECT_TRUE(open("other")->result->ok()) << "the node keeps serving others";
}

TEST_F(NodeTest, DriverWithoutHibernationStaysInTheMemoryTier) {
  driver_->can_hibernate = false;
  CreateRequest r = request("tiered", false, 1);
  r.hibernate_after_secs = 1;
  ASSERT_TRUE(create_request(r).ok());
  ASSERT_TRUE(wait_state("tiered", S::kSuspended));
  run_for(&loop_, 1500);
  EXPECT_EQ(driver_->hibernates, 0);
  EXPECT_EQ(node_->get("tiered")->tier, SuspendTier::kMemory);
  EXPECT_TRUE(node_->get("tiered")->next_transition.empty());
}

TEST_F(NodeTest, HibernateAfterDefaultsComeFromTheConfigAndAreValidated) {
  make_node("default_hibernate_after_secs = 77\nmax_timeout_secs = 100\n");
  auto info = create_request(request("demo", false, 10));
  ASSERT_TRUE(info.ok()) << info.message();
  EXPECT_EQ(info->spec.hibernate_after_secs, 77u);
  EXPECT_EQ(info->spec.driver, "fake");
  CreateRequest too_long = request("long", false, 10);
  too_long.hibernate_after_secs = 101;
  EXPECT_EQ(create_request(too_long).error(), Error::kInvalidArgument);
  CreateRequest negative = request("neg", false, 10);
  negative.hibernate_after_secs = -1;
  EXPECT_EQ(create_request(negative).error(), Error::kInvalidArgument);
  CreateRequest unknown = request("unknown", false, 10);
  unknown.driver = "firecracker";
  auto refused = create_request(unknown);
  EXPECT_EQ(refused.error(), Error::kInvalidArgument);
  EXPECT_NE(refused.message().find("'firecracker' is not enabled on this node (enabled: fake)"), std::string::npos)
      << refused.message();
}

TEST_F(NodeTest, ReconcileFindsHibernatedAndHalfHibernatedSandboxes) {
  CreateRequest r = request("on-disk", false, 1);
  r.hibernate_after_secs = 1;
  ASSERT_TRUE(create_request(r).ok());
  CreateRequest r2 = request("mid-way", false, 1);
  r2.hibernate_after_secs = 3;
  SandboxInfo mid = *create_request(r2);
  ASSERT_TRUE(run_until(&loop_, [&] { return hibernated("on-disk"); }, 4000));
  // "mid-way" is killed with the node during its hibernation (the record says suspending to disk); its VM is
  // still alive and paused, so it is suspended in memory.
  ASSERT_EQ(state("mid-way"), S::kSuspended);
  driver_->hibernate_delay_ms = 10'000;
  ASSERT_TRUE(run_until(&loop_, [&] { return state("mid-way") == S::kSuspending; }, 4000));
  restart();
  ASSERT_TRUE(node_->reconcile().ok());
  SandboxInfo disk = *node_->get("on-disk");
  EXPECT_EQ(disk.state, S::kSuspended);
  EXPECT_EQ(disk.tier, SuspendTier::kDisk);
  SandboxInfo memory = *node_->get("mid-way");
  EXPECT_EQ(memory.state, S::kSuspended);
  EXPECT_EQ(memory.tier, SuspendTier::kMemory);
  EXPECT_TRUE(driver_->instances[mid.spec.id].alive);
  auto o = open("on-disk");
  ASSERT_TRUE(run_until(&loop_, [&] { return o->result.has_value(); }));
  ASSERT_TRUE(o->result->ok()) << o->result->message();
  EXPECT_EQ(driver_->restores, 1);
}

// The node stopped between the `creating` record and the start's answer: no process was recorded, so there is
// nothing to adopt, and the caller never got an answer. The restarted node has the driver clean up what it
// may have started, and the record and the name go (e2e: NodeKill.ACreateKilledBefore...).
TEST_F(NodeTest, ReconcileRemovesACreateWhoseStartNeverAnswered) {
  driver_->start_delay_ms = 10'000;
  std::optional<Result<SandboxInfo>> created;
  node_->create(request("half"), [&](Result<SandboxInfo> r) { created.emplace(std::move(r)); });
  ASSERT_EQ(state("half"), S::kCreating);
  restart();
  ASSERT_TRUE(node_->reconcile().ok());
  ASSERT_TRUE(run_until(&loop_, [&] { return !node_->get("half").ok(); }));
  EXPECT_EQ(node_->get("half").error(), Error::kNotFound);
  EXPECT_EQ(driver_->terminates, 1) << "what the start may have left is released";
  EXPECT_TRUE((*Store::open(dir_.path() + "/node.db"))->load_live()->empty());
  driver_->start_delay_ms = 5;
  EXPECT_TRUE(create_request(request("half")).ok()) << "the name is free again";
}

// The node stopped while a removal was under way (the driver had not answered): the restarted node finishes
// it, with the instance still running or not, so nothing is left and the name is free.
TEST_F(NodeTest, ReconcileFinishesARemovalThatWasUnderWay) {
  ASSERT_TRUE(create_request(request("going")).ok());
  driver_->op_delay_ms = 10'000;  // the terminate never answers before the restart
  node_->remove("going", [](Result<SandboxInfo>) {});
  ASSERT_TRUE((*Store::open(dir_.path() + "/node.db"))->load_live()->at(0).terminating) << "recorded before it acts";
  restart();
  driver_->op_delay_ms = 5;
  ASSERT_TRUE(node_->reconcile().ok());
  ASSERT_TRUE(run_until(&loop_, [&] { return !node_->get("going").ok(); }));
  EXPECT_EQ(driver_->terminates, 1) << "terminated by the restarted node";
  EXPECT_TRUE((*Store::open(dir_.path() + "/node.db"))->load_live()->empty());
  EXPECT_TRUE(create_request(request("going")).ok()) << "the name is free again";
}

TEST_F(NodeTest, OpensDuringCreateWaitForTheStart) {
  driver_->start_delay_ms = 200;
  std::optional<Result<SandboxInfo>> created;
  node_->create(request("slow"), [&](Result<SandboxInfo> r) { created.emplace(std::move(r)); });
  EXPECT_FALSE(created.has_value()) << "answered when the driver has started it";
  EXPECT_EQ(state("slow"), S::kCreating);
  auto o = open("slow");
  EXPECT_FALSE(o->result.has_value());
  ASSERT_TRUE(run_until(&loop_, [&] { return created.has_value() && o->result.has_value(); }));
  ASSERT_TRUE(created->ok());
  EXPECT_EQ(created->value().state, S::kRunning);
  EXPECT_TRUE(o->result->ok());
}

TEST_F(NodeTest, DeleteDuringCreateTerminatesOnceStarted) {
  driver_->start_delay_ms = 100;
  std::optional<Result<SandboxInfo>> created;
  node_->create(request("short-lived"), [&](Result<SandboxInfo> r) { created.emplace(std::move(r)); });
  auto removed = remove("short-lived");
  ASSERT_TRUE(removed.has_value());
  ASSERT_TRUE(removed->ok()) << removed->message();
  ASSERT_TRUE(created.has_value());
  EXPECT_EQ(created->error(), Error::kConflict);
  EXPECT_EQ(driver_->terminates, 1);
  EXPECT_FALSE(node_->get("short-lived").ok());
}

TEST_F(NodeTest, OpenAnswersWithTheDriversConnectPort) {
  driver_->port_offset = 1000;
  create("demo");
  auto o = open("demo");
  ASSERT_TRUE(o->result->ok());
  EXPECT_EQ(o->result->value().port, 8080);
  EXPECT_EQ(o->result->value().socket.connect_port, 9080);
}

TEST_F(NodeTest, ShutdownWithNothingToDo) {
  make_node("on_shutdown = \"terminate\"\n");
  bool done = false;
  node_->shutdown([&] { done = true; });
  EXPECT_FALSE(done);
  ASSERT_TRUE(run_until(&loop_, [&] { return done; }));
}


// ---- checkpoints (the node's part: when one may run, and what the idle policy does meanwhile) ----

class NodeCheckpointTest : public NodeTest {
 protected:
  void SetUp() override {
    NodeTest::SetUp();
    auto records = snapshot::SnapshotStore::open(dir_.path() + "/images/snapshots");
    ASSERT_TRUE(records) << records.message();
    auto owned = std::make_unique<snapshot::SnapshotStore>(std::move(*records));
    auto images = snapshot::ImageStore::open(dir_.path() + "/images",
                                             [r = owned.get()] { return r->layers_in_use(); });
    ASSERT_TRUE(images) << images.message();
    images_ = std::move(*images);
    snapshots_ = std::make_unique<SnapshotService>(&loop_, std::move(owned), images_.get());
    node_->set_snapshots(snapshots_.get());
    upper_ = dir_.path() + "/upper";
    std::filesystem::create_directories(upper_);
    std::ofstream(upper_ + "/file") << "v1";
    driver_->checkpoint_upper = upper_;
  }
  void TearDown() override {
    driver_->freezer->release();  // a test that failed midway must not leave a pool thread blocked
    NodeTest::TearDown();
  }
  std::shared_ptr<std::optional<Result<snapshot::CheckpointResult>>> checkpoint(const std::string& ref,
                                                                                const std::string& type) {
    auto out = std::make_shared<std::optional<Result<snapshot::CheckpointResult>>>();
    node_->checkpoint(ref, type, [out](Result<snapshot::CheckpointResult> r) { out->emplace(std::move(r)); });
    return out;
  }

  Result<snapshot::Snapshot> remove_snapshot(const std::string& id) {
    std::optional<Result<snapshot::Snapshot>> removed;
    snapshots_->remove(id, [&](Result<snapshot::Snapshot> r) { removed.emplace(std::move(r)); });
    EXPECT_TRUE(run_until(&loop_, [&] { return removed.has_value(); }));
    return removed ? std::move(*removed) : Result<snapshot::Snapshot>(fail(Error::kInternal, "no answer"));
  }
  Result<SandboxInfo> remove_sandbox(const std::string& ref) {
    std::optional<Result<SandboxInfo>> gone;
    node_->remove(ref, [&](Result<SandboxInfo> r) { gone.emplace(std::move(r)); });
    EXPECT_TRUE(run_until(&loop_, [&] { return gone.has_value(); }));
    return gone ? std::move(*gone) : Result<SandboxInfo>(fail(Error::kInternal, "no answer"));
  }

  std::unique_ptr<snapshot::ImageStore> images_;
  std::unique_ptr<SnapshotService> snapshots_;
  std::string upper_;
};

TEST_F(NodeCheckpointTest, RefusalsNameTheReason) {
  create("box");
  auto memory = checkpoint("box", "memory");
  ASSERT_TRUE(memory->has_value());
  EXPECT_EQ((*memory)->error(), Error::kUnsupported);
  EXPECT_NE((*memory)->message().find("memory checkpoints are not supported"), std::string::npos);
  auto other = checkpoint("box", "disk");
  ASSERT_TRUE(other->has_value());
  EXPECT_EQ((*other)->error(), Error::kInvalidArgument);
  auto missing = checkpoint("nobody", "filesystem");
  ASSERT_TRUE(missing->has_value());
  EXPECT_EQ((*missing)->error(), Error::kNotFound);
  EXPECT_EQ(driver_->freezer->freezes, 0);
}

// A sandbox suspended in memory gets a memory checkpoint as it stands (the driver is told it is paused) and
// stays suspended; a request meanwhile wakes it once the checkpoint is done. So does a hibernated one (the
// driver copies its saved state); its filesystem checkpoint is refused.
TEST_F(NodeCheckpointTest, ASuspendedSandboxsMemoryCheckpointLeavesItSuspendedAndAWakeWaitsForIt) {
  driver_->can_checkpoint_memory = true;
  CreateRequest r = request("vm", false, 600);
  r.hibernate_after_secs = 600;
  ASSERT_TRUE(create_request(r));
  suspend_and_wait("vm");
  driver_->op_delay_ms = 200;
  auto result = checkpoint("vm", "memory");
  auto o = open("vm");
  run_for(&loop_, 100);
  EXPECT_EQ(state("vm"), S::kSuspended) << "no wake while the checkpoint saves it";
  ASSERT_TRUE(run_until(&loop_, [&] { return result->has_value(); }));
  ASSERT_TRUE(**result) << (*result)->message();
  EXPECT_EQ(driver_->last_memory_checkpoint_source, CheckpointFrom::kPaused);
  EXPECT_EQ((**result)->snapshot.type, "memory");
  ASSERT_TRUE(run_until(&loop_, [&] { return o->result.has_value(); }));
  ASSERT_TRUE(o->result->ok()) << o->result->message();
  EXPECT_EQ(state("vm"), S::kRunning);
  EXPECT_EQ(driver_->resumes, 1);

  // Without a wake it stays suspended; a running one is checkpointed unpaused.
  suspend_and_wait("vm");
  auto quiet = checkpoint("vm", "memory");
  ASSERT_TRUE(run_until(&loop_, [&] { return quiet->has_value(); }));
  ASSERT_TRUE(**quiet) << (*quiet)->message();
  run_for(&loop_, 100);
  EXPECT_EQ(state("vm"), S::kSuspended);
  EXPECT_EQ(driver_->resumes, 1);

  // The disk tier: a memory checkpoint copies what the hibernation saved, and it stays hibernated; a
  // filesystem checkpoint is refused, with the way out.
  CreateRequest tiered = request("tiered", false, 1);
  tiered.hibernate_after_secs = 1;
  ASSERT_TRUE(create_request(tiered));
  ASSERT_TRUE(run_until(&loop_, [&] { return hibernated("tiered"); }, 5000));
  auto disk = checkpoint("tiered", "memory");
  ASSERT_TRUE(run_until(&loop_, [&] { return disk->has_value(); }));
  ASSERT_TRUE(**disk) << (*disk)->message();
  EXPECT_EQ(driver_->last_memory_checkpoint_source, CheckpointFrom::kHibernated);
  EXPECT_TRUE(hibernated("tiered"));
  auto files = checkpoint("tiered", "filesystem");
  ASSERT_TRUE(files->has_value());
  EXPECT_EQ((*files)->error(), Error::kConflict);
  EXPECT_NE((*files)->message().find("in the disk tier; resume it first"), std::string::npos) << (*files)->message();
}

// A suspended sandbox's filesystem checkpoint reads its frozen upper dir and leaves it frozen; a wake asked for
// meanwhile (a request, or resume) follows the checkpoint, and the request is served then.
TEST_F(NodeCheckpointTest, ASuspendedSandboxIsCheckpointedAsItIsAndAWakeWaitsForIt) {
  create("box");
  suspend_and_wait("box");
  auto result = checkpoint("box", "filesystem");
  ASSERT_TRUE(run_until(&loop_, [&] { std::lock_guard l(driver_->freezer->mu); return driver_->freezer->frozen; }));
  auto resumed = node_->resume("box");
  ASSERT_TRUE(resumed) << resumed.message();
  auto o = open("box");
  run_for(&loop_, 200);
  EXPECT_EQ(state("box"), S::kSuspended) << "no wake while the checkpoint reads it";
  EXPECT_EQ(driver_->resumes, 0);
  EXPECT_FALSE(o->result.has_value());
  driver_->freezer->release();
  ASSERT_TRUE(run_until(&loop_, [&] { return result->has_value(); }));
  ASSERT_TRUE(**result) << (*result)->message();
  {
    std::lock_guard l(driver_->freezer->mu);
    EXPECT_TRUE(driver_->freezer->frozen) << "not thawed by the checkpoint";
  }
  ASSERT_TRUE(run_until(&loop_, [&] { return o->result.has_value(); }));
  ASSERT_TRUE(o->result->ok()) << o->result->message();
  EXPECT_EQ(state("box"), S::kRunning);
  EXPECT_EQ(driver_->resumes, 1);

  // Without a wake it stays suspended.
  suspend_and_wait("box");
  auto quiet = checkpoint("box", "filesystem");
  ASSERT_TRUE(run_until(&loop_, [&] { return quiet->has_value(); }));
  ASSERT_TRUE(**quiet) << (*quiet)->message();
  run_for(&loop_, 100);
  EXPECT_EQ(state("box"), S::kSuspended);
  EXPECT_EQ(driver_->resumes, 1);
}

TEST_F(NodeCheckpointTest, TheIdlePolicyWaitsForACheckpointAndTheSourceKeepsItsIdentity) {
  SandboxInfo box = create("box", false, 1);
  auto result = checkpoint("box", "filesystem");
  // The freeze is held: the idle timeout passes meanwhile, and neither it nor a request pauses the sandbox
  // (the checkpoint's own thaw would undo the pause).
  ASSERT_TRUE(run_until(&loop_, [&] { std::lock_guard l(driver_->freezer->mu); return driver_->freezer->frozen; }));
  auto again = checkpoint("box", "filesystem");
  ASSERT_TRUE(again->has_value());
  EXPECT_EQ((*again)->error(), Error::kConflict);
  auto suspend = node_->suspend("box");
  ASSERT_FALSE(suspend);
  EXPECT_EQ(suspend.error(), Error::kConflict);
  run_for(&loop_, 1500);
  EXPECT_EQ(driver_->pauses, 0);
  EXPECT_EQ(state("box"), S::kRunning);
  EXPECT_FALSE(result->has_value());

  driver_->freezer->release();
  ASSERT_TRUE(run_until(&loop_, [&] { return result->has_value(); }));
  ASSERT_TRUE(**result) << (*result)->message();
  const snapshot::Snapshot& snap = (**result)->snapshot;
  EXPECT_EQ(snap.source_id, box.spec.id);
  EXPECT_EQ(snap.command, box.spec.command);
  ASSERT_EQ(snap.ports.size(), 1u);
  EXPECT_EQ(snap.ports[0].port, 8080);
  EXPECT_FALSE(driver_->freezer->frozen);
  // The suspend the idle policy held back follows the checkpoint; the sandbox kept its id and token.
  ASSERT_TRUE(wait_state("box", S::kSuspended));
  EXPECT_EQ(driver_->pauses, 1);
  auto info = node_->get("box");
  ASSERT_TRUE(info);
  EXPECT_EQ(info->spec.id, box.spec.id);
  EXPECT_EQ(info->spec.token_sha256, box.spec.token_sha256);
  ASSERT_TRUE(snapshots_->get(snap.id));
}

TEST_F(NodeCheckpointTest, ACreateFromASnapshotRunsOnItsLayersWithItsDefaults) {
  create("box");
  driver_->freezer->release();
  auto result = checkpoint("box", "filesystem");
  ASSERT_TRUE(run_until(&loop_, [&] { return result->has_value(); }));
  ASSERT_TRUE(**result) << (*result)->message();
  const snapshot::Snapshot snap = (**result)->snapshot;
  CreateRequest from;
  from.name = "copy";
  from.snapshot_id = snap.id;
  from.memory_mb = 256;
  auto copy = create_request(from);
  ASSERT_TRUE(copy) << copy.message();
  EXPECT_EQ(copy->spec.snapshot, snap.id);
  EXPECT_EQ(copy->spec.layers, snap.layers);
  EXPECT_EQ(copy->spec.command, (std::vector<std::string>{"sleep", "infinity"}));
  EXPECT_EQ(copy->spec.exposed_ports, (std::vector<uint16_t>{8080}));
  EXPECT_EQ(copy->spec.memory_mb, 256u);
  // Removal is refused while `copy` lives, then allowed.
  auto refused = remove_snapshot(snap.id);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error(), Error::kConflict);
  EXPECT_NE(refused.message().find("in use by sandbox copy"), std::string::npos) << refused.message();
  ASSERT_TRUE(remove_sandbox("copy"));
  auto removed = remove_snapshot(snap.id);
  EXPECT_TRUE(removed) << removed.message();
  // A missing snapshot is a 404-class error naming it.
  auto missing = create_request(from);
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.error(), Error::kNotFound);
}

TEST_F(NodeCheckpointTest, AMemoryCheckpointIsCommittedWholeAndACreateFromItKeepsItsShape) {
  driver_->can_checkpoint_memory = true;
  CreateRequest req;
  req.name = "vm";
  req.command = {"sleep", "infinity"};
  req.memory_mb = 512;
  req.cpus = 2;
  auto vm = create_request(req);
  ASSERT_TRUE(vm) << vm.message();
  auto result = checkpoint("vm", "memory");
  ASSERT_TRUE(run_until(&loop_, [&] { return result->has_value(); }));
  ASSERT_TRUE(**result) << (*result)->message();
  const snapshot::Snapshot snap = (**result)->snapshot;
  EXPECT_EQ(snap.type, "memory");
  EXPECT_EQ(snap.memory_mb, 512u);
  EXPECT_EQ(snap.cpus, 2);
  EXPECT_EQ(snap.state_bytes, driver_->memory_state.size());
  EXPECT_EQ((**result)->pause_ms, 1.5);
  EXPECT_EQ(state("vm"), S::kRunning);
  // The files are in place under the record's name, nothing half-written is left.
  const std::string files = snapshots_->files_dir(snap.id);
  std::ifstream saved(files + "/" + kMemoryState);
  std::string text((std::istreambuf_iterator<char>(saved)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, driver_->memory_state);
  EXPECT_FALSE(std::filesystem::exists(files + ".tmp"));

  // A create from it runs the saved guest in its shape: another is refused, naming it.
  CreateRequest bigger;
  bigger.snapshot_id = snap.id;
  bigger.memory_mb = 1024;
  auto refused = create_request(bigger);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error(), Error::kInvalidArgument);
  EXPECT_NE(refused.message().find("memory snapshot of a 512 MiB guest"), std::string::npos) << refused.message();
  CreateRequest from;
  from.name = "vm-copy";
  from.snapshot_id = snap.id;
  auto copy = create_request(from);
  ASSERT_TRUE(copy) << copy.message();
  EXPECT_EQ(copy->spec.memory_mb, 512u);
  EXPECT_EQ(copy->spec.cpus, 2);
  EXPECT_TRUE(copy->spec.layers.empty());
  EXPECT_EQ(copy->spec.memory_snapshot_dir, files);
  EXPECT_EQ(driver_->started_from_memory, files);
  EXPECT_NE(copy->spec.id, vm->spec.id);

  // Each file is recorded with its digest, and a file that no longer matches it refuses the next create,
  // naming the file (the check is not fooled by the unchanged-file cache: the write changes the file's times).
  ASSERT_EQ(snap.file_digests.count(kMemoryState), 1u);
  EXPECT_EQ(snap.file_digests.at(kMemoryState), *snapshot::sha256_file(files + "/" + kMemoryState));
  std::ofstream(files + "/" + kMemoryState, std::ios::app) << "bit rot";
  CreateRequest damaged;
  damaged.snapshot_id = snap.id;
  auto refused_damaged = create_request(damaged);
  ASSERT_FALSE(refused_damaged);
  EXPECT_EQ(refused_damaged.error(), Error::kInvalidArgument);
  EXPECT_NE(refused_damaged.message().find("its file state is corrupted"), std::string::npos)
      << refused_damaged.message();

  // Removal waits for the last sandbox made from it, and takes its files.
  EXPECT_EQ(remove_snapshot(snap.id).error(), Error::kConflict);
  ASSERT_TRUE(remove_sandbox("vm-copy"));
  auto removed = remove_snapshot(snap.id);
  EXPECT_TRUE(removed) << removed.message();
  EXPECT_FALSE(std::filesystem::exists(files));
}

// A VM booted on a disk: its filesystem checkpoint is that disk (no layers), a create from it boots on it in
// any shape, and a checkpoint of that sandbox is the first one's child, as is a later checkpoint that holds
// only the changes over it. Removing a snapshot with children unlists it and keeps its files until the last
// child goes; a delta whose parent went meanwhile is refused.
TEST_F(NodeCheckpointTest, AVmsFilesystemCheckpointIsItsDiskAndAChildKeepsItsParent) {
  driver_->can_checkpoint_disk = true;
  CreateRequest req;
  req.name = "vm";
  req.command = {"sleep", "infinity"};
  req.memory_mb = 512;
  auto vm = create_request(req);
  ASSERT_TRUE(vm) << vm.message();
  auto result = checkpoint("vm", "filesystem");
  ASSERT_TRUE(run_until(&loop_, [&] { return result->has_value(); }));
  ASSERT_TRUE(**result) << (*result)->message();
  const snapshot::Snapshot snap = (**result)->snapshot;
  EXPECT_EQ(driver_->disk_checkpoints, 1);
  EXPECT_EQ(snap.type, "filesystem");
  EXPECT_TRUE(snap.is_vm_disk());
  EXPECT_TRUE(snap.layers.empty());
  EXPECT_EQ(snap.memory_mb, 0u) << "a cold boot from it takes any shape";
  EXPECT_EQ(snap.disk_bytes, driver_->disk_content.size());
  EXPECT_TRUE(snap.parent.empty());
  EXPECT_EQ(state("vm"), S::kRunning);
  const std::string disk = snapshots_->files_dir(snap.id) + "/" + kSnapshotDisk;
  EXPECT_EQ(snap.file_digests.at(kSnapshotDisk), *snapshot::sha256_file(disk));

  CreateRequest from;
  from.name = "vm-copy";
  from.snapshot_id = snap.id;
  from.memory_mb = 1024;
  auto copy = create_request(from);
  ASSERT_TRUE(copy) << copy.message();
  EXPECT_EQ(copy->spec.memory_mb, 1024u);
  EXPECT_EQ(copy->spec.snapshot_disk, disk);
  EXPECT_TRUE(copy->spec.memory_snapshot_dir.empty());
  EXPECT_EQ(driver_->started_on_disk, disk);

  auto second = checkpoint("vm-copy", "filesystem");
  ASSERT_TRUE(run_until(&loop_, [&] { return second->has_value(); }));
  ASSERT_TRUE(**second) << (*second)->message();
  const snapshot::Snapshot child = (**second)->snapshot;
  EXPECT_EQ(child.parent, snap.id);
  ASSERT_TRUE(remove_sandbox("vm-copy"));

  // The source's next checkpoint, a delta over the first (as the driver says).
  driver_->disk_delta_parent = snap.id;
  auto later = checkpoint("vm", "filesystem");
  ASSERT_TRUE(run_until(&loop_, [&] { return later->has_value(); }));
  ASSERT_TRUE(**later) << (*later)->message();
  const snapshot::Snapshot delta = (**later)->snapshot;
  EXPECT_EQ(delta.parent, snap.id);

  auto marked = remove_snapshot(snap.id);
  ASSERT_TRUE(marked) << marked.message();
  EXPECT_TRUE(marked->removed) << "removed outright while two snapshots' disks read its disk";
  EXPECT_TRUE(std::filesystem::exists(disk));
  auto listed = snapshots_->list();
  ASSERT_TRUE(listed);
  EXPECT_EQ(listed->size(), 2u);
  for (const auto& s : *listed) EXPECT_NE(s.id, snap.id);
  EXPECT_EQ(snapshots_->get(snap.id).error(), Error::kNotFound);
  CreateRequest from_removed = from;
  from_removed.name = "from-removed";
  auto not_found = create_request(from_removed);
  ASSERT_FALSE(not_found);
  EXPECT_EQ(not_found.error(), Error::kNotFound);
  EXPECT_EQ(remove_snapshot(snap.id).error(), Error::kNotFound) << "removed twice";
  ASSERT_TRUE(remove_snapshot(child.id));
  EXPECT_TRUE(std::filesystem::exists(disk)) << "its files went while " << delta.id << " reads them";
  auto last = remove_snapshot(delta.id);
  ASSERT_TRUE(last) << last.message();
  EXPECT_FALSE(last->removed);
  EXPECT_FALSE(std::filesystem::exists(disk)) << "the removed parent stayed after its last child went";
  EXPECT_FALSE(std::filesystem::exists(snapshots_->files_dir(snap.id)));

  // A delta over a snapshot that is gone is never recorded.
  driver_->disk_delta_parent = snap.id;
  auto orphan = checkpoint("vm", "filesystem");
  ASSERT_TRUE(run_until(&loop_, [&] { return orphan->has_value(); }));
  ASSERT_FALSE(**orphan);
  EXPECT_EQ((*orphan)->error(), Error::kConflict);
  EXPECT_NE((*orphan)->message().find("removed meanwhile"), std::string::npos) << (*orphan)->message();
  listed = snapshots_->list();
  ASSERT_TRUE(listed);
  EXPECT_TRUE(listed->empty());
  driver_->disk_delta_parent.clear();

  // Hibernated: checkpointed as it stands (the driver copies its disk), and it stays so.
  CreateRequest tiered = request("tiered", false, 1);
  tiered.hibernate_after_secs = 1;
  ASSERT_TRUE(create_request(tiered));
  ASSERT_TRUE(run_until(&loop_, [&] { return hibernated("tiered"); }, 5000));
  auto asleep = checkpoint("tiered", "filesystem");
  ASSERT_TRUE(run_until(&loop_, [&] { return asleep->has_value(); }));
  ASSERT_TRUE(**asleep) << (*asleep)->message();
  EXPECT_EQ(driver_->last_disk_checkpoint_source, CheckpointFrom::kHibernated);
  EXPECT_TRUE(hibernated("tiered"));
}

TEST_F(NodeCheckpointTest, AFailedMemoryCheckpointLeavesNoSnapshotAndTheSandboxRunning) {
  driver_->can_checkpoint_memory = true;
  driver_->fail_memory_checkpoint = true;
  create("vm");
  auto result = checkpoint("vm", "memory");
  ASSERT_TRUE(run_until(&loop_, [&] { return result->has_value(); }));
  ASSERT_FALSE(**result);
  EXPECT_NE((*result)->message().find("migration to the state file failed"), std::string::npos);
  EXPECT_EQ(state("vm"), S::kRunning);
  auto all = snapshots_->list();
  ASSERT_TRUE(all);
  EXPECT_TRUE(all->empty());
  // The half-written files go too (on the pool: wait for them).
  EXPECT_TRUE(run_until(&loop_, [&] {
    std::error_code ec;
    auto it = std::filesystem::directory_iterator(dir_.path() + "/images/snapshots", ec);
    return !ec && it == std::filesystem::directory_iterator();
  }));
  // And a second checkpoint is not refused as "in progress".
  driver_->fail_memory_checkpoint = false;
  auto again = checkpoint("vm", "memory");
  ASSERT_TRUE(run_until(&loop_, [&] { return again->has_value(); }));
  EXPECT_TRUE(**again) << (*again)->message();
}

// noderuntime/fork.h, on the node with the fake driver (the fixture above).
TEST_F(NodeCheckpointTest, AForkMakesEverySandboxFromOneMemorySnapshotOrNoneOfThem) {
  driver_->can_checkpoint_memory = true;
  create("vm");
  std::optional<Result<ForkResult>> forked;
  fork_sandbox(*node_, "vm", ForkRequest{.count = 2, .name_prefix = std::nullopt},
               [&](Result<ForkResult> r) { forked.emplace(std::move(r)); });
  ASSERT_TRUE(run_until(&loop_, [&] { return forked.has_value(); }));
  ASSERT_TRUE(*forked) << forked->message();
  ASSERT_EQ((*forked)->sandboxes.size(), 2u);
  EXPECT_EQ((*forked)->sandboxes[0].spec.name, "vm-fork-1");
  EXPECT_EQ((*forked)->sandboxes[1].spec.name, "vm-fork-2");
  EXPECT_NE((*forked)->sandboxes[0].token, (*forked)->sandboxes[1].token);
  for (const SandboxInfo& f : (*forked)->sandboxes) {
    EXPECT_EQ(f.spec.snapshot, (*forked)->snapshot.id);
    EXPECT_EQ(state(f.spec.name), S::kRunning);
  }
  EXPECT_EQ(driver_->memory_checkpoints, 1);

  // The second name is taken: the first fork goes again, the snapshot stays, the error says all of it.
  create("x-2");
  forked.reset();
  fork_sandbox(*node_, "vm", ForkRequest{.count = 2, .name_prefix = "x"},
               [&](Result<ForkResult> r) { forked.emplace(std::move(r)); });
  ASSERT_TRUE(run_until(&loop_, [&] { return forked.has_value(); }));
  ASSERT_FALSE(*forked);
  EXPECT_EQ(forked->error(), Error::kAlreadyExists);
  EXPECT_NE(forked->message().find("fork 2 of 2"), std::string::npos) << forked->message();
  EXPECT_NE(forked->message().find("stays"), std::string::npos) << forked->message();
  EXPECT_TRUE(run_until(&loop_, [&] { return !node_->get("x-1"); }));
  auto all = snapshots_->list();
  ASSERT_TRUE(all);
  EXPECT_EQ(all->size(), 2u);

  // A driver that cannot save processes cannot fork.
  driver_->can_checkpoint_memory = false;
  forked.reset();
  fork_sandbox(*node_, "vm", ForkRequest{}, [&](Result<ForkResult> r) { forked.emplace(std::move(r)); });
  ASSERT_TRUE(run_until(&loop_, [&] { return forked.has_value(); }));
  EXPECT_EQ(forked->error(), Error::kUnsupported);
}

TEST(ForkNames, TheSourcesNameWithForkUnlessThereIsNoneOrNoRoom) {
  EXPECT_EQ(default_fork_prefix("alice"), "alice-fork");
  EXPECT_EQ(default_fork_prefix(""), "");
  EXPECT_EQ(default_fork_prefix(std::string(56, 'a')), "") << "no room for -fork-NN in a DNS label";
  EXPECT_EQ(default_fork_prefix(std::string(55, 'a')), std::string(55, 'a') + "-fork");
}

// ---- the fleet hooks ([fleet]), with a fake in place of etcd ----

class FakeFleet : public FleetHooks {
 public:
  const std::string& node_name() const override { return name; }
  Status admit(FleetAdmission what) const override {
    if (fenced) return fail(Error::kUnavailable, "fleet: fenced, refuses to " + std::string(admission_words(what)));
    return {};
  }
  void claim(const std::string& name, std::function<void(Status)> done) override {
    claims.push_back(name);
    if (taken.count(name)) return done(fail(Error::kAlreadyExists, "name '" + name + "' is taken by node '" + taken[name] + "'"));
    taken[name] = "me";
    done({});
  }
  void publish(const std::string& key, std::string_view state, std::vector<fleet::PortRoute> ports) override {
    published.emplace_back(key, std::string(state));
    published_ports[key] = std::move(ports);
    if (state == "terminated") taken.erase(key);
  }
  void publish_ports(const std::string& key, std::vector<fleet::PortRoute> ports) override {
    published_ports[key] = std::move(ports);
  }
  std::map<std::string, std::vector<fleet::PortRoute>> published_ports;
  std::string name = "me";
  bool fenced = false;
  std::map<std::string, std::string> taken;
  std::vector<std::string> claims;
  std::vector<std::pair<std::string, std::string>> published;
};

class NodeFleetTest : public NodeTest {
 protected:
  void SetUp() override {
    NodeTest::SetUp();
    node_->set_fleet(&fleet_);
  }
  FakeFleet fleet_;
};

TEST_F(NodeFleetTest, ANamedCreateClaimsFirstAndEveryStateThatRoutesIsPublished) {
  SandboxInfo a = create("a");
  ASSERT_EQ(a.state, S::kRunning);
  EXPECT_EQ(fleet_.claims, std::vector<std::string>{"a"});
  suspend_and_wait("a");
  ASSERT_TRUE(remove("a")->ok());
  using P = std::pair<std::string, std::string>;
  EXPECT_EQ(fleet_.published, (std::vector<P>{{"a", "running"}, {"a", "suspended"}, {"a", "terminated"}}));
  // An unnamed sandbox claims nothing (its id is unique anyway) and is published under its id.
  SandboxInfo u = create(std::nullopt);
  EXPECT_EQ(fleet_.claims.size(), 1u);
  EXPECT_EQ(fleet_.published.back(), (P{u.spec.id, "running"}));
}

// Another node's proxy picks ALPN and the raw-TCP mode by the ports the owner publishes with its state, and
// again whenever they change.
TEST_F(NodeFleetTest, PortsArePublishedWithTheStateAndAgainWhenTheyChange) {
  SandboxInfo a = create("a");
  using PR = fleet::PortRoute;
  // The agent's port too (h2c, never public): the SDK route.
  const PR agent{a.spec.agent_port, "h2c", false};
  ASSERT_NE(agent.port, 0);
  EXPECT_EQ(fleet_.published_ports["a"], (std::vector<PR>{agent, {8080, "http1", false}}));
  std::optional<Result<SandboxInfo>> out;
  node_->expose_port("a", 2222, ExposeRequest{true, "tcp"}, [&](Result<SandboxInfo> r) { out.emplace(std::move(r)); });
  ASSERT_TRUE(run_until(&loop_, [&] { return out.has_value(); }));
  ASSERT_TRUE(out->ok()) << out->message();
  EXPECT_EQ(fleet_.published_ports["a"], (std::vector<PR>{agent, {8080, "http1", false}, {2222, "tcp", true}}));
  ASSERT_TRUE(node_->close_port("a", 8080).ok());
  EXPECT_EQ(fleet_.published_ports["a"], (std::vector<PR>{agent, {2222, "tcp", true}}));
}

TEST_F(NodeFleetTest, ALocalDuplicateNamesThisNode) {
  create("dup");
  auto r = create_request(request("dup"));
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), Error::kAlreadyExists);
  EXPECT_NE(r.message().find("on node 'me'"), std::string::npos) << r.message();
}

TEST_F(NodeFleetTest, ARefusedClaimIsTheCreatesAnswerAndStartsNothing) {
  fleet_.taken["web"] = "n2";
  auto r = create_request(request("web"));
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), Error::kAlreadyExists);
  EXPECT_NE(r.message().find("node 'n2'"), std::string::npos) << r.message();
  EXPECT_EQ(driver_->starts, 0);
  EXPECT_TRUE(node_->list().empty());
}

TEST_F(NodeFleetTest, AFailedStartGivesTheNameBack) {
  driver_->fail_start = true;
  auto r = create_request(request("x"));
  ASSERT_FALSE(r);
  EXPECT_EQ(fleet_.taken.count("x"), 0u);
  ASSERT_FALSE(fleet_.published.empty());
  EXPECT_EQ(fleet_.published.back().second, "terminated");
}

TEST_F(NodeFleetTest, AFencedNodeRefusesCreatesAndWakesButRunningSandboxesServe) {
  create("up");
  create("asleep");
  suspend_and_wait("asleep");
  fleet_.fenced = true;
  auto r = create_request(request("new"));
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), Error::kUnavailable);
  EXPECT_EQ(create_request(request(std::nullopt)).error(), Error::kUnavailable);
  auto woken = open("asleep");
  ASSERT_TRUE(run_until(&loop_, [&] { return woken->result.has_value(); }));
  ASSERT_FALSE(*woken->result);
  EXPECT_EQ(woken->result->error(), Error::kUnavailable);
  EXPECT_EQ(state("asleep"), S::kSuspended);
  EXPECT_EQ(node_->resume("asleep").error(), Error::kUnavailable);
  auto served = open("up");
  ASSERT_TRUE(run_until(&loop_, [&] { return served->result.has_value(); }));
  EXPECT_TRUE(*served->result) << served->result->message();
  fleet_.fenced = false;
  EXPECT_TRUE(node_->resume("asleep"));
  EXPECT_TRUE(wait_state("asleep", S::kRunning));
}

}  // namespace
}  // namespace sg
