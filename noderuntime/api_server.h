// The node API (docs/node-api.md) over HTTP/1.1 on libuv: the unix socket `node_socket` (what the proxy and
// the CLI use; the only listener that can pass file descriptors) plus any `node.api_listen` TCP addresses,
// which need the operator token and refuse foreign Host and any Origin (refuse_tcp). Keep-alive and pipelining are supported; responses leave in request order even when a later
// request finishes first. Every body is JSON, parsed without exceptions and type-checked field by field,
// so malformed input is a 400 and never takes the daemon down.
#pragma once

#include <uv.h>

#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/error.h"
#include "common/fd.h"
#include "common/http.h"
#include "common/net.h"
#include "config/config.h"
#include "noderuntime/image_service.h"
#include "noderuntime/node.h"
#include "noderuntime/placement.h"
#include "noderuntime/snapshot_service.h"
#include "noderuntime/ssh_keys.h"

namespace sg {

class ApiServer {
 public:
  // `node` and `config` must outlive the server.
  ApiServer(uv_loop_t* loop, Node* node, const ConfigHolder* config);
  // close() must have completed (its callback ran) before destruction.
  ~ApiServer() = default;
  ApiServer(const ApiServer&) = delete;
  ApiServer& operator=(const ApiServer&) = delete;

  // The node's images (/v1/images); without them those endpoints answer 503. `images` must outlive the server.
  void set_images(ImageService* images) { images_ = images; }
  // The node's snapshots (/v1/snapshots); without them those endpoints answer 503. Must outlive the server.
  void set_snapshots(SnapshotService* snapshots) { snapshots_ = snapshots; }
  // The registered SSH keys (/v1/ssh-keys); without them those endpoints answer 503. Must outlive the server.
  void set_ssh_keys(SshKeyStore* keys) { ssh_keys_ = keys; }
  // [fleet]: GET /v1/fleet/nodes, POST/DELETE /v1/fleet/nodes/<node>/drain, and each sandbox's "node".
  void set_fleet(FleetAdmin* fleet) { fleet_ = fleet; }
  // With a fleet: a create that does not name the node that placed it is placed on a node chosen from the
  // fleet's view (noderuntime/placement.h), this one included.
  void enable_placement(PlacementOptions options, CreatePlacer::RemoteCreate remote = {});

  // Starts accepting on `ep`: a unix socket (replacing a stale file, mode 0660) or a TCP address.
  Status listen(const Endpoint& ep);
  // Stops listening and closes every connection (answers still in flight are dropped); `done` runs once
  // every handle is closed.
  void close(std::function<void()> done);

  // A streamed answer (POST /v1/images/build): 200 with a close-delimited application/x-ndjson body, one
  // JSON line per send(), the connection closed after end(). Lines sent before the connection reaches the
  // answer wait in the stream. Loop thread only.
  class Stream {
   public:
    // `droppable`: a line a slow reader may lose (build output) once kMaxQueuedWriteBytes wait to be written;
    // the others (steps, the final answer) always go.
    void send(std::string line, bool droppable);
    void end();
    // The connection takes the lines from here on (those waiting first) and is told of the end.
    void attach(std::function<void(std::string, bool)> sink, std::function<void()> on_end);

   private:
    std::function<void(std::string, bool)> sink_;
    std::function<void()> on_end_;
    std::vector<std::pair<std::string, bool>> pending_;
    bool ended_ = false;
  };

  // One complete answer: status, JSON body, and for internal/open and internal/sockets the descriptors
  // that travel with it.
  struct Response {
    int status = 200;
    std::string body;
    std::vector<UniqueFd> fds;
    std::string extra_headers;  // "Name: value\r\n" lines
    // internal/events: the connection becomes a stream of RouteEvents (one JSON line each) until either
    // side closes it; no request after it is read.
    bool route_events = false;
    std::shared_ptr<Stream> stream = nullptr;  // set: the body is this stream, not `body`
  };
  using Reply = std::function<void(Response)>;

 private:
  class Connection;
  struct Listener;

  void on_connection(Listener* listener, int status);
  void on_handle_closed();
  // Routes one request; `reply` runs exactly once, possibly before route() returns.
  void route(const HttpMessage& request, bool can_pass_fds, Reply reply);
  Response sandbox_response(int status, const SandboxInfo& info) const;
  // The TCP listeners' gate, before routing (the unix socket's file mode is its access control): a Host
  // other than `hosts` (the connection's own address) is 421, an Origin header 403, a request without the
  // operator token 401. nullopt: let it through.
  std::optional<Response> refuse_tcp(const HttpMessage& request, const std::vector<std::string>& hosts) const;

  void handle_create(const HttpMessage& request, Reply reply);
  void handle_open(const HttpMessage& request, bool can_pass_fds, Reply reply);
  void handle_lookup(const HttpMessage& request, bool is_unix, Reply& reply);
  void handle_sockets(const HttpMessage& request, bool can_pass_fds, Reply& reply);
  void handle_activity(const HttpMessage& request, Reply& reply);
  void handle_image_import(const HttpMessage& request, bool is_unix, Reply reply);
  void handle_image_build(const HttpMessage& request, bool is_unix, Reply reply);

  uv_loop_t* loop_;
  Node* node_;
  ImageService* images_ = nullptr;
  SnapshotService* snapshots_ = nullptr;
  SshKeyStore* ssh_keys_ = nullptr;
  void handle_ssh_keys(const HttpMessage& request, std::string_view path, Reply reply);
  FleetAdmin* fleet_ = nullptr;
  std::unique_ptr<CreatePlacer> placer_;
  std::mt19937_64 placement_rng_{std::random_device{}()};
  const ConfigHolder* config_;
  std::vector<Listener*> listeners_;
  std::unordered_map<Connection*, std::shared_ptr<Connection>> connections_;
  size_t open_handles_ = 0;
  bool closing_ = false;
  std::function<void()> close_done_;
};

}  // namespace sg
