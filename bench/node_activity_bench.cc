// The node's side of the activity report at scale: Node::activity over reports for 10,000 running
// sandboxes (a lookup, the reporter's connection count, an idle-tracker touch each), the part of the
// report's cost that BM_ParseActivityReport does not include. The sandboxes run on the unit tests' fake
// driver (no processes), created once.
#include <benchmark/benchmark.h>
#include <uv.h>

#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "noderuntime/node.h"
#include "noderuntime/store.h"
#include "tests/unit/node/fake_driver.h"

namespace sg {
namespace {

struct NodeWithSandboxes {
  uv_loop_t loop;
  testing::TempDir dir{"sg-bench-activity"};
  std::unique_ptr<ConfigHolder> config;
  std::unique_ptr<Node> node;
  std::vector<std::string> ids;
  std::string error;

  explicit NodeWithSandboxes(size_t n) {
    uv_loop_init(&loop);
    auto cfg = load_config_string("[node]\nstate_dir = \"" + dir.path() + "\"\nmax_sandboxes = " +
                                      std::to_string(n) + "\n",
                                  "bench.toml");
    if (!cfg.ok()) {
      error = cfg.message();
      return;
    }
    config = std::make_unique<ConfigHolder>(*cfg);
    auto store = Store::open(dir.path() + "/node.db");
    if (!store.ok()) {
      error = store.message();
      return;
    }
    std::vector<std::unique_ptr<Driver>> drivers;
    drivers.push_back(std::make_unique<testing::FakeDriver>(&loop));
    node = std::make_unique<Node>(&loop, config.get(), std::move(drivers), std::move(*store));
    for (size_t i = 0; i < n && error.empty(); ++i) {
      CreateRequest r;
      r.name = "bench-" + std::to_string(i);
      r.command = {"sleep", "infinity"};
      r.timeout_secs = 3600;
      bool answered = false;
      node->create(r, [&](Result<SandboxInfo> info) {
        answered = true;
        if (info) ids.push_back(info->spec.id);
        else error = info.message();
      });
      if (!testing::run_until(&loop, [&] { return answered; })) error = "create never answered";
    }
  }
};

void BM_NodeActivity(benchmark::State& state) {
  static NodeWithSandboxes fixture(10000);  // made once: 10,000 creates take seconds
  if (!fixture.error.empty()) return state.SkipWithError(fixture.error.c_str());
  const size_t n = static_cast<size_t>(state.range(0));
  std::vector<ActivityReport> reports;
  for (size_t i = 0; i < n; ++i) reports.push_back(ActivityReport{fixture.ids[i], "w0", 100, 1000, 1});
  for (auto _ : state) {
    ActivityAnswer answer = fixture.node->activity(reports);
    benchmark::DoNotOptimize(answer);
  }
}
BENCHMARK(BM_NodeActivity)->Arg(100)->Arg(10000)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace sg
