// sandgate-node: runs sandboxes on this host and serves the node API (docs/node-api.md).
//
//   sandgate-node --config /etc/sandgate/sandgate.toml [--state-dir DIR] [--socket unix:/path]
//
// SIGINT/SIGTERM: graceful shutdown per node.on_shutdown, exit 0. SIGHUP: reload the config file and re-read
// the operator token file (so a rotated token replaces the old one at once); limits and defaults apply to the
// next request, listeners and the state dir stay as they are until a restart.
#include <sys/stat.h>
#include <uv.h>

#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "common/log.h"
#include "common/net.h"
#include "config/config.h"
#include "noderuntime/fleet_member.h"
#include "noderuntime/api_server.h"
#include "noderuntime/guest_disk.h"
#include "noderuntime/image_service.h"
#include "noderuntime/snapshot_service.h"
#include "noderuntime/node.h"
#include "noderuntime/port_exposure.h"
#include "noderuntime/cloud_hypervisor_driver.h"
#include "noderuntime/firecracker_driver.h"
#include "noderuntime/process_driver.h"
#include "noderuntime/qemu_driver.h"
#include "noderuntime/sandbox_egress.h"
#include "common/service_notify.h"
#include "noderuntime/store.h"

namespace {

struct Overrides {
  std::string state_dir;
  std::string socket;
};

// The command line wins over the file, on every (re)load.
sg::Result<std::shared_ptr<const sg::Config>> load(const std::string& path, const Overrides& overrides) {
  auto loaded = sg::load_config_file(path);
  if (!loaded) return loaded;
  if (overrides.state_dir.empty() && overrides.socket.empty()) return loaded;
  auto cfg = std::make_shared<sg::Config>(**loaded);
  if (!overrides.state_dir.empty()) cfg->node.state_dir = overrides.state_dir;
  if (!overrides.socket.empty()) {
    auto ep = sg::parse_endpoint(overrides.socket);
    if (!ep || ep->kind != sg::Endpoint::Kind::kUnix)
      return sg::fail(sg::Error::kInvalidArgument, "--socket: must be unix:/path");
    cfg->node_socket = *ep;
  }
  return std::shared_ptr<const sg::Config>(std::move(cfg));
}

// `perms` applies only to a directory this call creates: an existing one (say /run, or a state dir the
// operator prepared) keeps the mode its owner gave it.
sg::Status make_dir(const std::string& dir, std::filesystem::perms perms) {
  std::error_code ec;
  bool created = std::filesystem::create_directories(dir, ec);
  if (ec) return sg::fail(sg::Error::kIo, "cannot create " + dir + ": " + ec.message());
  if (!created) return {};
  std::filesystem::permissions(dir, perms, ec);
  if (ec) return sg::fail(sg::Error::kIo, "cannot set permissions of " + dir + ": " + ec.message());
  return {};
}

// listen_on() replaces a stale socket file; make sure it is stale and not a live node's.
bool socket_in_use(const sg::Endpoint& ep) { return sg::connect_blocking(ep, 200).ok(); }

struct Daemon {
  uv_loop_t* loop = nullptr;
  std::string config_path;
  Overrides overrides;
  std::unique_ptr<sg::ConfigHolder> config;
  // Before node: the drivers the node owns attach sandboxes to it until they are gone.
  std::unique_ptr<sg::SandboxEgress> egress;
  std::unique_ptr<sg::FleetMember> fleet;  // [fleet] only; before node: the node points at it
  std::unique_ptr<sg::Node> node;
  std::unique_ptr<sg::SnapshotService> snapshots;  // before images: the image store's GC asks it
  std::unique_ptr<sg::ImageService> images;  // before server: the server points at it
  std::unique_ptr<sg::SshKeyStore> ssh_keys;  // before server: the server points at it
  std::unique_ptr<sg::ApiServer> server;
  uv_signal_t sigint{}, sigterm{}, sighup{};
  bool stopping = false;
  std::string ready_status;  // the STATUS= systemd shows while the node serves

  // systemd hears RELOADING=1 first and READY=1 again whatever the outcome (a failed reload keeps serving).
  void reload() {
    sg::notify_reloading();
    apply_reload();
    sg::notify_ready(ready_status);
  }
  void apply_reload() {
    auto next = load(config_path, overrides);
    if (!next) {
      spdlog::error("reload failed, keeping the current config:\n{}", next.message());
      return;
    }
    // Before the swap, so a token file that became unusable leaves both the old config and token in place.
    if (auto s = node->load_operator_token(**next); !s) {
      spdlog::error("reload failed, keeping the current config and operator token:\n{}", s.message());
      return;
    }
    auto current = config->get();
    const sg::Config& n = **next;
    bool moved = n.node_socket.to_string() != current->node_socket.to_string() ||
                 n.node.socket_group != current->node.socket_group || n.node.state_dir != current->node.state_dir ||
                 n.node.api_listen.size() != current->node.api_listen.size();
    for (size_t i = 0; !moved && i < n.node.api_listen.size(); ++i)
      moved = n.node.api_listen[i].to_string() != current->node.api_listen[i].to_string();
    config->swap(*next);
    spdlog::info("reloaded {}: limits, defaults and the operator token apply from now on", config_path);
    if (moved)
      spdlog::warn("node_socket, node.socket_group, node.api_listen and node.state_dir changes take effect only "
                   "after a restart");
  }

  void stop(int signum) {
    if (stopping) return;
    stopping = true;
    sg::notify_stopping("stopping: closing the API, then the sandboxes per node.on_shutdown");
    spdlog::info("received {}, shutting down (on_shutdown = {})", signum == SIGINT ? "SIGINT" : "SIGTERM",
                 config->get()->node.on_shutdown == sg::ShutdownPolicy::kTerminate ? "terminate" : "keep");
    server->close([this] {
      node->shutdown([this] {
        // The sandboxes' last states (terminated, with on_shutdown = terminate) reach etcd, then the lease is
        // revoked: the node key goes now, the sandbox keys of those kept running stay.
        if (fleet) fleet->stop();
        for (uv_signal_t* s : {&sigint, &sigterm, &sighup}) uv_close(reinterpret_cast<uv_handle_t*>(s), nullptr);
        // The driver may keep handles of its own open; the loop ends here regardless.
        uv_stop(loop);
      });
    });
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"sandgate-node: runs sandboxes and serves the node API"};
  Daemon d;
  app.add_option("--config", d.config_path, "TOML config file")->required();
  app.add_option("--state-dir", d.overrides.state_dir, "override node.state_dir");
  app.add_option("--socket", d.overrides.socket, "override node_socket (unix:/path)");
  CLI11_PARSE(app, argc, argv);

  auto cfg = load(d.config_path, d.overrides);
  if (!cfg) {
    std::fprintf(stderr, "sandgate-node: invalid config:\n%s\n", cfg.message().c_str());
    return 2;
  }
  sg::init_logging("sandgate-node", (*cfg)->log_level);
  // Writes to a client that went away must fail with EPIPE, not kill the daemon.
  std::signal(SIGPIPE, SIG_IGN);
  d.config = std::make_unique<sg::ConfigHolder>(*cfg);
  const sg::Config& c = **cfg;

  using std::filesystem::perms;
  if (auto s = make_dir(c.node.state_dir, perms::owner_all); !s) {
    spdlog::critical("{}", s.message());
    return 1;
  }
  std::string socket_dir = std::filesystem::path(c.node_socket.path).parent_path().string();
  if (!socket_dir.empty()) {
    if (auto s = make_dir(socket_dir, perms::owner_all | perms::group_read | perms::group_exec | perms::others_read |
                                          perms::others_exec);
        !s) {
      spdlog::critical("{}", s.message());
      return 1;
    }
  }
  if (socket_in_use(c.node_socket)) {
    spdlog::critical("another sandgate-node is already serving on {}", c.node_socket.to_string());
    return 1;
  }

  d.loop = uv_default_loop();
  auto store = sg::Store::open(c.node.state_dir + "/node.db");
  if (!store) {
    spdlog::critical("cannot open the state database: {}", store.message());
    return 1;
  }
  // Images and their layers (snapshot/image_store.h); opening collects layers an interrupted import left
  // unreferenced. Opened before the drivers: process sandboxes' root filesystems and QEMU disks come from it.
  // Snapshot records sit next to the layers they name, so every node sharing a layer store keeps them.
  auto snapshot_store = sg::snapshot::SnapshotStore::open(c.node.images_root() + "/snapshots");
  if (!snapshot_store) {
    spdlog::critical("cannot open the snapshot store: {}", snapshot_store.message());
    return 1;
  }
  auto snapshot_records = std::make_unique<sg::snapshot::SnapshotStore>(std::move(*snapshot_store));
  auto images = sg::snapshot::ImageStore::open(
      c.node.images_root(), [records = snapshot_records.get()] { return records->layers_in_use(); });
  if (!images) {
    spdlog::critical("cannot open the image store: {}", images.message());
    return 1;
  }
  sg::snapshot::ImageStore* image_store = images->get();
  image_store->layers().set_free_space_reserve(uint64_t{c.node.store_free_space_reserve_mb} << 20);
  std::vector<std::unique_ptr<sg::Driver>> drivers;
  // One egress for both drivers that give sandboxes internet access: one bridge, table and slot space.
  d.egress = std::make_unique<sg::SandboxEgress>(c.node);
  auto process_driver = sg::make_process_driver(d.loop, c.node, image_store, d.egress.get());
  if (!process_driver) {
    spdlog::critical("cannot initialise the process driver: {}", process_driver.message());
    return 1;
  }
  drivers.push_back(std::move(*process_driver));
  // Always offered: the guest image is built on first use (noderuntime/guest_image.h), and an image that
  // cannot be had fails each sandbox's start with the reason, not the node.
  drivers.push_back(sg::make_qemu_driver(
      d.loop, c.node, c.agent_port, [image_store](const std::string& name) -> sg::Result<std::vector<std::string>> {
        auto image = image_store->get(name);  // lock-free: never waits for an import
        if (!image) return image.failure();
        std::vector<std::string> trees;
        for (const std::string& digest : image->layers) trees.push_back(image_store->layers().tree_path(digest));
        return trees;
      },
      d.egress.get()));
  // The microVM drivers boot the same guest image; they are offered when their binary is configured.
  const std::string kernel = c.node.guest_kernel_file();
  const std::string initrd = c.node.guest_initrd_file();
  if (!c.node.firecracker_binary.empty()) {
    sg::FirecrackerConfig fc;
    fc.binary = c.node.firecracker_binary;
    fc.kernel_image_path = kernel;
    fc.initrd_path = initrd;
    fc.batch_scheduling = c.node.batch_scheduling;
    drivers.push_back(sg::make_firecracker_driver(d.loop, std::move(fc)));
  }
  if (!c.node.cloud_hypervisor_binary.empty()) {
    sg::CloudHypervisorConfig ch;
    ch.binary = c.node.cloud_hypervisor_binary;
    ch.kernel = kernel;
    ch.initramfs = initrd;
    ch.batch_scheduling = c.node.batch_scheduling;
    drivers.push_back(sg::make_cloud_hypervisor_driver(d.loop, std::move(ch)));
  }
  d.node = std::make_unique<sg::Node>(d.loop, d.config.get(), std::move(drivers), std::move(*store));
  d.node->set_images(image_store);
  d.snapshots = std::make_unique<sg::SnapshotService>(d.loop, std::move(snapshot_records), image_store);
  d.node->set_snapshots(d.snapshots.get());
  if (c.fleet.enabled) {
    size_t capacity = c.fleet.capacity_sandboxes != 0 ? c.fleet.capacity_sandboxes : c.node.max_sandboxes;
    d.fleet = std::make_unique<sg::FleetMember>(d.loop, c.fleet, capacity);
    d.node->set_fleet(d.fleet.get());
    // The store outlives the fleet's threads (stop() joins them before `images` goes).
    d.fleet->set_image_names([image_store] { return image_store->names(); });
    d.fleet->set_resources([config = d.config.get(), reserved = d.node->reservations()] {
      auto cfg = config->get();
      return sg::FleetMember::Resources{cfg->node.max_memory_mb, static_cast<int64_t>(reserved->memory_mb.load()),
                                        int64_t{cfg->node.max_cpus} * 1000, static_cast<int64_t>(reserved->millicpus.load())};
    });
  }
  // `image rm` is refused while a sandbox's root filesystem comes from the image, or a snapshot's does, and no
  // sandbox starts on an image while it is being removed. Snapshots first: a claim is only taken when it
  // holds (a snapshot is made from a running sandbox, itself a user, so none can appear between the two).
  image_store->set_users(
      [users = d.node->image_users(), snapshots = d.snapshots.get()](const std::string& name) {
        if (auto snapshot = snapshots->image_user(name)) return snapshot;
        return users->claim_for_removal(name);
      },
      [users = d.node->image_users()](const std::string& name) { users->release_removal(name); });
  if (auto s = d.node->load_operator_token(c); !s) {
    spdlog::critical("{}", s.message());
    return 1;
  }
  if (auto s = d.node->reconcile(); !s) {
    spdlog::critical("cannot reconcile sandboxes from the store: {}", s.message());
    return 1;
  }
  if (d.fleet) {
    // What the store adopted is this node's: the first registration reconciles it against etcd (re-claims
    // what etcd lost, reports names another node holds, removes keys of sandboxes gone from here).
    for (const sg::SandboxInfo& info : d.node->list()) {
      // The settled state each one is headed for (what the node publishes once it gets there).
      std::string_view state = info.state == sg::SandboxState::kSuspending ? "suspended"
                               : info.state == sg::SandboxState::kResuming ? "running"
                                                                           : sg::state_name(info.state);
      if (info.state != sg::SandboxState::kCreating)
        d.fleet->publish(info.spec.name.empty() ? info.spec.id : info.spec.name, state, sg::fleet_port_routes(info.spec));
    }
    if (auto s = d.fleet->start(); !s) {
      spdlog::critical("cannot start the fleet membership: {}", s.message());
      return 1;
    }
  }
  d.images = std::make_unique<sg::ImageService>(d.loop, std::move(*images));
  // A QEMU base disk goes once its image's layers do: at an `image rm`, and now for one removed while the
  // node was down.
  const std::string qemu_disks = sg::guest_disks_dir(c.node.state_dir);
  sg::remove_orphaned_guest_disks(qemu_disks);
  d.images->set_after_remove([qemu_disks] { sg::remove_orphaned_guest_disks(qemu_disks); });
  d.server = std::make_unique<sg::ApiServer>(d.loop, d.node.get(), d.config.get());
  d.server->set_images(d.images.get());
  d.server->set_snapshots(d.snapshots.get());
  auto ssh_keys = sg::SshKeyStore::open(sg::ssh_keys_dir(c.node.state_dir));
  if (!ssh_keys) {
    spdlog::critical("ssh keys: {}", ssh_keys.message());
    return 1;
  }
  d.ssh_keys = std::make_unique<sg::SshKeyStore>(std::move(*ssh_keys));
  d.server->set_ssh_keys(d.ssh_keys.get());
  if (d.fleet) {
    d.server->set_fleet(d.fleet.get());
    d.server->enable_placement(sg::PlacementOptions{c.fleet.node_name, c.operator_token_file, c.fleet.api_cacert});
  }
  std::vector<sg::Endpoint> endpoints = {c.node_socket};
  endpoints.insert(endpoints.end(), c.node.api_listen.begin(), c.node.api_listen.end());
  for (const sg::Endpoint& ep : endpoints) {
    if (auto s = d.server->listen(ep); !s) {
      spdlog::critical("cannot listen on {}: {}", ep.to_string(), s.message());
      return 1;
    }
  }

  for (uv_signal_t* s : {&d.sigint, &d.sigterm, &d.sighup}) {
    uv_signal_init(d.loop, s);
    s->data = &d;
  }
  auto on_stop = [](uv_signal_t* s, int signum) { static_cast<Daemon*>(s->data)->stop(signum); };
  uv_signal_start(&d.sigint, on_stop, SIGINT);
  uv_signal_start(&d.sigterm, on_stop, SIGTERM);
  uv_signal_start(&d.sighup, [](uv_signal_t* s, int) { static_cast<Daemon*>(s->data)->reload(); }, SIGHUP);

  std::printf("sandgate-node ready on %s\n", c.node_socket.to_string().c_str());
  std::fflush(stdout);
  d.ready_status = "serving on " + c.node_socket.to_string() + " (" + std::to_string(d.node->sandbox_count()) +
                   " sandboxes adopted)";
  sg::notify_ready(d.ready_status);
  uv_run(d.loop, UV_RUN_DEFAULT);

  // Free what is left in order: server and node close their handles; one more turn runs the close callbacks.
  d.server.reset();
  if (d.fleet) d.fleet->close();
  d.node.reset();
  uv_run(d.loop, UV_RUN_NOWAIT);
  d.fleet.reset();
  d.images.reset();
  d.snapshots.reset();
  spdlog::info("sandgate-node stopped");
  return 0;
}
