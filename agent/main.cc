// sandgate-agent: runs inside every sandbox and serves exec, files and health to the SDK (agent/README.md).
//
//   sandgate-agent [--listen 0.0.0.0:9501] [--max-upload-bytes N] [--max-execs N] [--max-connections N]
//                  [--max-contexts N] [--python python3]
//
// Prints "sandgate-agent ready on <addr:port>" once listening. SIGINT/SIGTERM: stop accepting, kill the
// commands still running (their whole process groups), close every connection, exit 0.
#include <uv.h>

#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdio>
#include <string>

#include "agent/server.h"
#include "common/net.h"

namespace {

struct Daemon {
  uv_loop_t* loop = nullptr;
  sg::agent::AgentServer* server = nullptr;
  uv_signal_t sigint{}, sigterm{};

  void stop() {
    server->close();
    for (uv_signal_t* s : {&sigint, &sigterm}) uv_close(reinterpret_cast<uv_handle_t*>(s), nullptr);
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"sandgate-agent: exec, files, run_code and health inside a sandbox, over HTTP/1.1 and h2c"};
  std::string listen = "0.0.0.0:9501";
  sg::agent::AgentLimits limits;
  app.add_option("--listen", listen, "address:port to listen on (port 0: any free port)")->capture_default_str();
  app.add_option("--max-upload-bytes", limits.max_upload_bytes, "largest PUT /files body")->capture_default_str();
  app.add_option("--max-execs", limits.max_execs, "commands running at once (429 beyond)")->capture_default_str();
  app.add_option("--max-connections", limits.max_connections, "open connections (closed at once beyond)")
      ->capture_default_str();
  app.add_option("--max-contexts", limits.code.max_contexts, "run_code interpreters at once (429 beyond)")
      ->capture_default_str();
  app.add_option("--python", limits.code.settings.python, "run_code's interpreter (looked up in PATH)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  auto ep = sg::parse_endpoint(listen);
  if (!ep) {
    std::fprintf(stderr, "sandgate-agent: --listen: %s\n", ep.message().c_str());
    return 2;
  }
  // Writes to a client that went away, or to a command that closed its stdin, must fail with EPIPE.
  std::signal(SIGPIPE, SIG_IGN);

  Daemon d;
  d.loop = uv_default_loop();
  sg::agent::AgentServer server(d.loop, limits);
  d.server = &server;
  if (auto s = server.listen(*ep); !s) {
    std::fprintf(stderr, "sandgate-agent: %s\n", s.message().c_str());
    return 1;
  }
  for (auto [handle, signum] : {std::pair{&d.sigint, SIGINT}, std::pair{&d.sigterm, SIGTERM}}) {
    uv_signal_init(d.loop, handle);
    handle->data = &d;
    uv_signal_start(handle, [](uv_signal_t* h, int) { static_cast<Daemon*>(h->data)->stop(); }, signum);
  }
  std::printf("sandgate-agent ready on %s\n", server.address().c_str());
  std::fflush(stdout);
  // Returns once every connection has closed and every killed command has been reaped.
  uv_run(d.loop, UV_RUN_DEFAULT);
  uv_loop_close(d.loop);
  return 0;
}
