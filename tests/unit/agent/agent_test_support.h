// What the agent's in-process tests share: a command's output and status, and an NDJSON stream split into
// its events.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <uv.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "agent/server.h"
#include "common/net.h"

namespace sg::agent::test_support {

struct Ran {
  int status = -1;
  std::string out;
};

// Runs `command` with the shell; its stdout and exit status (-1 if it did not exit normally).
inline Ran run(const std::string& command) {
  Ran r;
  FILE* f = ::popen(command.c_str(), "r");
  if (f == nullptr) return r;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) r.out.append(buf, n);
  int st = ::pclose(f);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

// One JSON value per non-empty line (a line that is not JSON becomes a discarded value).
inline std::vector<nlohmann::json> ndjson(const std::string& text) {
  std::vector<nlohmann::json> events;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    if (nl > pos) events.push_back(nlohmann::json::parse(text.substr(pos, nl - pos), nullptr, false));
    pos = nl + 1;
  }
  return events;
}

// The agent served in-process on its own loop and thread, on a loopback port, with a temp dir for the
// files a test writes; `limits()` is what a test suite changes.
class InProcessAgentTest : public ::testing::Test {
 protected:
  virtual AgentLimits limits() const { return {}; }

  void SetUp() override {
    std::signal(SIGPIPE, SIG_IGN);
    char dir[] = "/tmp/sandgate-agent-test-XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
    uv_loop_init(&loop_);
    server_ = std::make_unique<AgentServer>(&loop_, limits());
    auto s = server_->listen(*parse_endpoint("127.0.0.1:0"));
    ASSERT_TRUE(s.ok()) << s.message();
    uv_async_init(&loop_, &stop_, [](uv_async_t* a) {
      static_cast<AgentServer*>(a->data)->close();
      uv_close(reinterpret_cast<uv_handle_t*>(a), nullptr);
    });
    stop_.data = server_.get();
    thread_ = std::thread([this] { uv_run(&loop_, UV_RUN_DEFAULT); });
  }

  void TearDown() override {
    if (thread_.joinable()) {
      uv_async_send(&stop_);
      // The loop ends once every connection closed and every killed command and interpreter was reaped.
      thread_.join();
    }
    server_.reset();
    uv_loop_close(&loop_);
    std::filesystem::remove_all(dir_);
  }

  std::string url(std::string_view path) const { return "http://" + server_->address() + std::string(path); }

  std::string write_file(const std::string& name, const std::string& content) {
    std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << content;
    return path;
  }

  std::string dir_;
  uv_loop_t loop_{};
  uv_async_t stop_{};
  std::unique_ptr<AgentServer> server_;
  std::thread thread_;
};

}  // namespace sg::agent::test_support
