// run_code through the agent's HTTP endpoints, driven with curl (HTTP/1.1 and h2c) against the agent served
// in-process, with Debian's /usr/bin/python3 as the interpreter (pandas and matplotlib from Debian too).
#include "agent/code_service.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "agent/server.h"

#include "tests/unit/agent/agent_test_support.h"

namespace sg::agent {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

constexpr const char* kH2 = "--http2-prior-knowledge ";
constexpr const char* kPython = "/usr/bin/python3";  // Debian's, where python3-pandas and -matplotlib install

using test_support::Ran;
using test_support::run;
using test_support::ndjson;

std::vector<std::string> types(const std::vector<json>& events) {
  std::vector<std::string> out;
  for (const json& e : events) out.push_back(e.is_object() ? e.value("type", "?") : "<not json>");
  return out;
}

std::string text_of(const std::vector<json>& events, const std::string& type) {
  std::string out;
  for (const json& e : events)
    if (e.value("type", "") == type && e.contains("data")) out += e["data"].get<std::string>();
  return out;
}

bool eventually(const std::function<bool()>& condition, int timeout_ms = 10000) {
  auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (Clock::now() < deadline) {
    if (condition()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return condition();
}

std::string base64_decode(const std::string& in) {
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    int v = c >= 'A' && c <= 'Z'   ? c - 'A'
            : c >= 'a' && c <= 'z' ? c - 'a' + 26
            : c >= '0' && c <= '9' ? c - '0' + 52
            : c == '+'             ? 62
            : c == '/'             ? 63
                                   : -1;
    if (v < 0) continue;  // '=' padding
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xFF);
    }
  }
  return out;
}

uint32_t be32(const std::string& s, size_t at) {
  return (static_cast<uint32_t>(static_cast<uint8_t>(s[at])) << 24) |
         (static_cast<uint32_t>(static_cast<uint8_t>(s[at + 1])) << 16) |
         (static_cast<uint32_t>(static_cast<uint8_t>(s[at + 2])) << 8) | static_cast<uint8_t>(s[at + 3]);
}

const std::string kJson = "-H 'Content-Type: application/json' ";

class CodeTest : public test_support::InProcessAgentTest {
 protected:
  AgentLimits limits() const override {
    AgentLimits l;
    l.code.max_contexts = 3;
    l.code.max_code_bytes = 64 * 1024;
    l.code.settings.python = kPython;
    l.code.settings.max_event_bytes = 256 * 1024;
    l.code.settings.max_run_output_bytes = 1024 * 1024;
    l.code.settings.interrupt_grace_ms = 500;
    return l;
  }

  // A POST with a JSON body through curl: the status code on the last line, after the body.
  Ran post(const std::string& path, const json& body, const char* proto = "") {
    std::string file = write_file("body-" + std::to_string(++bodies_) + ".json", body.dump());
    return run("curl -sS -N " + kJson + proto + "-w '\\n%{http_code}' --data-binary @" + file + " " + url(path));
  }

  static int code_of(const Ran& r) { return std::atoi(r.out.substr(r.out.rfind('\n') + 1).c_str()); }
  static std::string body_of(const Ran& r) { return r.out.substr(0, r.out.rfind('\n')); }

  // One run; its events (the test fails unless it streamed 200 and ended with an end event).
  std::vector<json> run_code(const std::string& code, const std::string& context = "", const char* proto = "",
                             int timeout_secs = 0, const std::string& language = "") {
    json body = {{"code", code}};
    if (!context.empty()) body["context"] = context;
    if (!language.empty()) body["language"] = language;
    if (timeout_secs > 0) body["timeout_secs"] = timeout_secs;
    Ran r = post("/run_code", body, proto);
    EXPECT_EQ(code_of(r), 200) << r.out;
    auto events = ndjson(body_of(r));
    EXPECT_FALSE(events.empty());
    if (!events.empty()) {
      EXPECT_EQ(events.back().value("type", ""), "end") << r.out;
    }
    return events;
  }

  std::string new_context() {
    Ran r = post("/contexts", {{"language", "python"}});
    EXPECT_EQ(code_of(r), 201) << r.out;
    return json::parse(body_of(r), nullptr, false).value("id", "");
  }

  json context_info(const std::string& id) {
    Ran r = run("curl -sS " + url("/contexts/" + id));
    return json::parse(r.out, nullptr, false);
  }

  int http_status(const std::string& curl_args) {
    return std::atoi(run("curl -sS -o /dev/null -w '%{http_code}' " + curl_args).out.c_str());
  }

  int bodies_ = 0;
};

TEST_F(CodeTest, StateIsKeptAcrossCallsAndAFinalExpressionIsTheResult) {
  for (const char* proto : {"", kH2}) {
    SCOPED_TRACE(proto);
    auto a = run_code("x = 40\ndef add(a, b):\n    return a + b\n", "", proto);
    EXPECT_EQ(types(a), (std::vector<std::string>{"end"}));
    EXPECT_EQ(a.back().value("context", ""), "default");
    auto b = run_code("y = add(x, 2)\ny", "", proto);
    ASSERT_EQ(types(b), (std::vector<std::string>{"result", "end"}));
    EXPECT_EQ(b[0]["data"]["text/plain"], "42");
    // A final expression that is None (a call with no value) is no result, as in a REPL; _ is the last one.
    auto c = run_code("print('p')\nNone", "", proto);
    EXPECT_EQ(types(c), (std::vector<std::string>{"stdout", "end"}));
    auto d = run_code("_ + 1", "", proto);
    ASSERT_EQ(types(d), (std::vector<std::string>{"result", "end"}));
    EXPECT_EQ(d[0]["data"]["text/plain"], "43");
  }
}

TEST_F(CodeTest, StdoutAndStderrKeepTheirOrderWithWhatSubprocessesWrite) {
  auto e = run_code(
      "import sys, os, subprocess\n"
      "print('one')\n"
      "print('two', file=sys.stderr)\n"
      "os.system('echo three')\n"
      "subprocess.run(['sh', '-c', 'echo four >&2'])\n"
      "sys.stdout.write('fi'); sys.stdout.write('ve\\n')\n"
      "print('six', file=sys.stderr)\n"
      "print('seven')\n"
      "sys.stdout.buffer.write(b'eight\\n')\n"
      "subprocess.run(['echo', 'nine'], stdout=sys.stdout)\n"
      "print('ten', file=sys.stderr)\n");
  std::vector<std::string> got;
  for (const json& ev : e)
    if (ev.contains("data")) got.push_back(ev["type"].get<std::string>() + ":" + ev["data"].get<std::string>());
  EXPECT_EQ(got, (std::vector<std::string>{"stdout:one\n", "stderr:two\n", "stdout:three\n", "stderr:four\n",
                                           "stdout:five\n", "stderr:six\n", "stdout:seven\n",
                                           "stdout:eight\n", "stdout:nine\n", "stderr:ten\n"}));
}

TEST_F(CodeTest, EventsStreamWhileTheCodeRuns) {
  for (const char* proto : {"", kH2}) {
    std::string file = write_file("slow.json", json{{"code", "import time\nprint('first')\ntime.sleep(1.5)\nprint('second')"}}.dump());
    auto t0 = Clock::now();
    FILE* f = ::popen(("curl -sS -N " + kJson + proto + "--data-binary @" + file + " " + url("/run_code")).c_str(), "r");
    ASSERT_NE(f, nullptr);
    char line[4096];
    ASSERT_NE(std::fgets(line, sizeof line, f), nullptr);
    auto first_at = Clock::now() - t0;
    EXPECT_EQ(json::parse(line, nullptr, false).value("data", ""), "first\n");
    std::string rest;
    while (std::fgets(line, sizeof line, f) != nullptr) rest += line;
    auto end_at = Clock::now() - t0;
    ::pclose(f);
    EXPECT_LT(first_at, std::chrono::milliseconds(1200)) << "the first line waited for the run to end";
    EXPECT_GE(end_at, std::chrono::milliseconds(1500));
    EXPECT_EQ(types(ndjson(rest)), (std::vector<std::string>{"stdout", "end"}));
  }
}

TEST_F(CodeTest, AnExceptionIsAStructuredErrorWithTheCellsTraceback) {
  auto e = run_code("def f(n):\n    return 10 / n\nprint('before')\nf(0)\nprint('not reached')");
  ASSERT_EQ(types(e), (std::vector<std::string>{"stdout", "error", "end"}));
  const json& err = e[1];
  EXPECT_EQ(err["name"], "ZeroDivisionError");
  EXPECT_EQ(err["message"], "division by zero");
  ASSERT_TRUE(err["traceback"].is_array());
  std::string tb;
  for (const json& l : err["traceback"]) tb += l.get<std::string>() + "\n";
  EXPECT_NE(tb.find("line 4, in <module>"), std::string::npos) << tb;
  EXPECT_NE(tb.find("line 2, in f"), std::string::npos) << tb;
  EXPECT_NE(tb.find("return 10 / n"), std::string::npos) << "the cell's source is shown\n" << tb;
  EXPECT_EQ(tb.find("code_driver"), std::string::npos) << "driver frames leak\n" << tb;
  EXPECT_EQ(tb.find("<string>"), std::string::npos) << "driver frames leak\n" << tb;

  auto s = run_code("def broken(:\n  pass");
  ASSERT_EQ(types(s), (std::vector<std::string>{"error", "end"}));
  EXPECT_EQ(s[0]["name"], "SyntaxError");
  // sys.exit() and raise SystemExit end the cell, not the context.
  auto x = run_code("k = 7\nimport sys\nsys.exit(3)");
  ASSERT_EQ(types(x), (std::vector<std::string>{"error", "end"}));
  EXPECT_EQ(x[0]["name"], "SystemExit");
  EXPECT_EQ(run_code("k")[0]["data"]["text/plain"], "7");
}

TEST_F(CodeTest, ATimeoutInterruptsTheRunAndKeepsTheContext) {
  run_code("kept = 'still here'");
  auto t0 = Clock::now();
  auto e = run_code("import time\nprint('sleeping')\ntime.sleep(30)", "", "", 1);
  auto took = Clock::now() - t0;
  ASSERT_EQ(types(e), (std::vector<std::string>{"stdout", "error", "end"}));
  EXPECT_EQ(e[1]["name"], "KeyboardInterrupt");
  EXPECT_EQ(e[2].value("timed_out", false), true);
  EXPECT_LT(took, std::chrono::seconds(10));
  auto after = run_code("kept");
  ASSERT_EQ(types(after), (std::vector<std::string>{"result", "end"}));
  EXPECT_EQ(after[0]["data"]["text/plain"], "'still here'");
}

TEST_F(CodeTest, CodeThatIgnoresTheInterruptIsKilledAndTheContextRestartsSayingItsStateIsLost) {
  run_code("lost = 1");
  int pid = context_info("default").value("pid", 0);
  ASSERT_GT(pid, 0);
  auto e = run_code(
      "import time\nwhile True:\n    try:\n        time.sleep(10)\n    except KeyboardInterrupt:\n        pass", "", "", 1);
  ASSERT_EQ(types(e), (std::vector<std::string>{"error", "end"}));
  EXPECT_EQ(e[0]["name"], "InterpreterDied");
  EXPECT_NE(e[0]["message"].get<std::string>().find("did not stop within 500 ms"), std::string::npos) << e[0];
  EXPECT_NE(e[0]["message"].get<std::string>().find("state is lost"), std::string::npos) << e[0];
  EXPECT_EQ(context_info("default").value("state", ""), "dead");
  // The next run starts a fresh interpreter and says so first.
  auto next = run_code("'lost' in globals()");
  ASSERT_EQ(types(next), (std::vector<std::string>{"restarted", "result", "end"}));
  EXPECT_NE(next[0]["message"].get<std::string>().find("names defined before are gone"), std::string::npos);
  EXPECT_EQ(next[1]["data"]["text/plain"], "False");
  EXPECT_NE(context_info("default").value("pid", 0), pid);
  // An interpreter that exits on its own between runs is restarted the same way.
  auto quit = run_code("import os\nos._exit(5)");
  ASSERT_EQ(types(quit), (std::vector<std::string>{"error", "end"}));
  EXPECT_NE(quit[0]["message"].get<std::string>().find("exited with code 5"), std::string::npos) << quit[0];
  EXPECT_EQ(types(run_code("1"))[0], "restarted");
}

// A bash context keeps its shell's state (variables, functions, the working directory) from run to run; a
// failing cell is an error with its exit status, a timeout interrupts the cell's program and keeps the
// shell, and `exit` ends the shell, which the next run replaces, saying so.
TEST_F(CodeTest, ABashContextKeepsItsShellsStateAndReportsExitStatuses) {
  // The output as "stream:text" per run of one stream (how the text is cut into events depends on reads).
  auto std_events = [](const std::vector<json>& e) {
    std::string out, last;
    for (const json& ev : e) {
      const std::string type = ev.value("type", "");
      if (type != "stdout" && type != "stderr") continue;
      out += (type == last ? "" : type + ":") + ev.value("data", "");
      last = type;
    }
    return out;
  };
  auto a = run_code("n=41; cd /tmp; plus() { echo $(( $1 + 1 )); }\necho one; echo two >&2", "", "", 0, "bash");
  EXPECT_EQ(types(a).back(), "end");
  EXPECT_EQ(std_events(a), "stdout:one\nstderr:two\n");
  auto b = run_code("plus $n; pwd; sh -c 'echo from-a-child'", "", "", 0, "bash");
  EXPECT_EQ(std_events(b), "stdout:42\n/tmp\nfrom-a-child\n") << b.back();
  // The default bash context is its own: the default Python context knows nothing of it.
  auto py = run_code("'n' in globals()");
  EXPECT_EQ(py[0]["data"]["text/plain"], "False");
  EXPECT_EQ(context_info("default-bash").value("language", ""), "bash");

  auto failed = run_code("echo before; ls /no/such/dir", "", "", 0, "bash");
  ASSERT_EQ(types(failed).back(), "end");
  const json& error = failed[failed.size() - 2];
  EXPECT_EQ(error.value("type", ""), "error");
  EXPECT_EQ(error.value("name", ""), "ExitStatus");
  EXPECT_EQ(error.value("message", ""), "exit status 2");
  EXPECT_NE(std_events(failed).find("No such file or directory"), std::string::npos) << std_events(failed);
  // A cell reads no stdin (it is /dev/null), so `read` cannot hang a run.
  EXPECT_EQ(std_events(run_code("read line; echo \"read $?\"", "", "", 0, "bash")), "stdout:read 1\n");

  auto t0 = Clock::now();
  auto slept = run_code("echo sleeping; sleep 30; echo not-reached", "", "", 1, "bash");
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(10));
  ASSERT_EQ(types(slept), (std::vector<std::string>{"stdout", "error", "end"}));
  EXPECT_EQ(slept[1]["name"], "KeyboardInterrupt");
  EXPECT_EQ(slept[2].value("timed_out", false), true);
  EXPECT_EQ(std_events(run_code("echo \"n is $n\"", "", "", 0, "bash")), "stdout:n is 41\n") << "the shell was kept";

  auto quit = run_code("exit 3", "", "", 0, "bash");
  ASSERT_EQ(types(quit), (std::vector<std::string>{"error", "end"}));
  EXPECT_EQ(quit[0]["name"], "ShellExited");
  EXPECT_NE(quit[0]["message"].get<std::string>().find("status 3"), std::string::npos) << quit[0];
  EXPECT_EQ(std_events(run_code("echo \"n is ${n:-gone}\"", "", "", 0, "bash")), "stdout:n is gone\n");

  // A context made for bash, and a language that does not match the context's.
  Ran made = post("/contexts", {{"language", "bash"}});
  ASSERT_EQ(code_of(made), 201) << made.out;
  const std::string id = json::parse(body_of(made), nullptr, false).value("id", "");
  EXPECT_EQ(std_events(run_code("echo $((6 * 7))", id)), "stdout:42\n");
  Ran mismatch = post("/run_code", {{"code", "1"}, {"context", id}, {"language", "python"}});
  EXPECT_EQ(code_of(mismatch), 400) << mismatch.out;
  EXPECT_NE(mismatch.out.find("runs bash, not python"), std::string::npos) << mismatch.out;
}

TEST_F(CodeTest, ResetAndDeleteContexts) {
  std::string id = new_context();
  ASSERT_EQ(id.size(), 32u);
  run_code("v = 5", id);
  EXPECT_EQ(run_code("v", id)[0]["data"]["text/plain"], "5");
  Ran r = post("/contexts/" + id + "/reset", json::object());
  ASSERT_EQ(code_of(r), 200) << r.out;
  EXPECT_EQ(json::parse(body_of(r), nullptr, false).value("state", ""), "idle");
  auto gone = run_code("v", id);
  ASSERT_EQ(types(gone), (std::vector<std::string>{"error", "end"}));
  EXPECT_EQ(gone[0]["name"], "NameError");

  int pid = context_info(id).value("pid", 0);
  ASSERT_GT(pid, 0);
  EXPECT_EQ(http_status("-X DELETE " + url("/contexts/" + id)), 204);
  EXPECT_EQ(http_status(url("/contexts/" + id)), 404);
  EXPECT_EQ(http_status("-X DELETE " + url("/contexts/" + id)), 404);
  EXPECT_EQ(code_of(post("/run_code", {{"code", "1"}, {"context", id}})), 404);
  EXPECT_EQ(code_of(post("/contexts/" + id + "/reset", json::object())), 404);
  EXPECT_TRUE(eventually([&] { return ::kill(pid, 0) != 0; })) << "the interpreter outlived its context";
}

TEST_F(CodeTest, OneRunAtATimePerContextAndDeleteEndsARunInProgress) {
  std::string id = new_context();
  std::string file = write_file("long.json", json{{"code", "import time\nprint('started', flush=True)\ntime.sleep(60)"},
                                                  {"context", id}}.dump());
  FILE* f = ::popen(("curl -sS -N " + kJson + "--data-binary @" + file + " " + url("/run_code")).c_str(), "r");
  ASSERT_NE(f, nullptr);
  char line[4096];
  ASSERT_NE(std::fgets(line, sizeof line, f), nullptr);  // running now
  EXPECT_EQ(context_info(id).value("state", ""), "running");
  Ran second = post("/run_code", {{"code", "1"}, {"context", id}});
  EXPECT_EQ(code_of(second), 409) << second.out;
  EXPECT_EQ(json::parse(body_of(second), nullptr, false).value("error", ""), "conflict");
  // Other contexts are not held up.
  EXPECT_EQ(run_code("2")[0]["data"]["text/plain"], "2");
  EXPECT_EQ(http_status("-X DELETE " + url("/contexts/" + id)), 204);
  std::string rest;
  while (std::fgets(line, sizeof line, f) != nullptr) rest += line;
  ::pclose(f);
  auto events = ndjson(rest);
  ASSERT_EQ(types(events), (std::vector<std::string>{"error", "end"})) << rest;
  EXPECT_EQ(events[0]["name"], "ContextDeleted");
}

TEST_F(CodeTest, TwoContextsAreIndependent) {
  std::string a = new_context(), b = new_context();
  ASSERT_NE(a, b);
  run_code("name = 'a'", a);
  run_code("name = 'b'", b);
  EXPECT_EQ(run_code("name", a)[0]["data"]["text/plain"], "'a'");
  EXPECT_EQ(run_code("name", b)[0]["data"]["text/plain"], "'b'");
  EXPECT_EQ(types(run_code("name")), (std::vector<std::string>{"error", "end"})) << "the default context is a third";
  json list = json::parse(run("curl -sS " + url("/contexts")).out, nullptr, false);
  ASSERT_EQ(list["contexts"].size(), 3u) << list;
  std::set<int> pids;
  for (const json& c : list["contexts"]) pids.insert(c.value("pid", 0));
  EXPECT_EQ(pids.size(), 3u) << "one interpreter each";
}

TEST_F(CodeTest, LimitsAndBadRequestsGetClearErrors) {
  // max_contexts = 3, the default context included.
  new_context();
  new_context();
  run_code("1");
  Ran over = post("/contexts", {{"language", "python"}});
  EXPECT_EQ(code_of(over), 429) << over.out;
  EXPECT_NE(body_of(over).find("3 contexts exist already"), std::string::npos) << over.out;

  // Code: at most 64 KiB.
  EXPECT_EQ(types(run_code("s = '" + std::string(60 * 1024, 'a') + "'\nlen(s)")).front(), "result");
  Ran big = post("/run_code", {{"code", std::string(64 * 1024 + 1, '#')}});
  EXPECT_EQ(code_of(big), 413) << big.out;
  // The request body too (checked while reading).
  std::string huge = write_file("huge.json", "{\"code\": \"" + std::string(1024 * 1024, 'x') + "\"}");
  EXPECT_EQ(http_status(kJson + "--data-binary @" + huge + " " + url("/run_code")), 413);

  struct Case {
    json body;
    int status;
    std::string mentions;
  };
  for (const Case& c : {Case{json::object(), 400, "code is required"}, Case{{{"code", 5}}, 400, "code: must be a string"},
                        Case{{{"code", "1"}, {"timeout_secs", -1}}, 400, "timeout_secs"},
                        Case{{{"code", "1"}, {"context", "../x"}}, 400, "not a context id"},
                        Case{{{"code", "1"}, {"context", "nope"}}, 404, "no such context"},
                        Case{{{"code", "1"}, {"extra", 1}}, 400, "unknown field 'extra'"}}) {
    Ran r = post("/run_code", c.body);
    EXPECT_EQ(code_of(r), c.status) << c.body << r.out;
    EXPECT_NE(body_of(r).find(c.mentions), std::string::npos) << c.body << r.out;
  }
  Ran lang = post("/contexts", {{"language", "cobol"}});
  EXPECT_EQ(code_of(lang), 400);
  EXPECT_NE(body_of(lang).find("supported: python"), std::string::npos) << lang.out;
  EXPECT_EQ(http_status("-X POST -H 'Content-Type: text/plain' -d '{\"code\":\"1\"}' " + url("/run_code")), 415);
  EXPECT_EQ(http_status("-X POST " + url("/contexts/default/reset")), 415);
  EXPECT_EQ(http_status(url("/run_code")), 405);
  EXPECT_EQ(http_status("-X PUT " + url("/contexts")), 405);
  EXPECT_EQ(http_status(url("/contexts/a/b")), 404);
}

TEST_F(CodeTest, EventAndPerRunOutputSizesAreBounded) {
  // 600 KiB printed at once leaves as several events of at most 256 KiB each, nothing lost.
  auto split = run_code("print('x' * (600 * 1024), end='')");
  size_t total = 0;
  for (const json& e : split) {
    if (e.value("type", "") != "stdout") continue;
    EXPECT_LE(e.dump().size(), 256u * 1024 + 4096);
    total += e["data"].get<std::string>().size();
  }
  EXPECT_EQ(total, 600u * 1024);
  EXPECT_GE(split.size(), 4u);

  // A display over the event limit keeps its text/plain and says what was dropped.
  auto display = run_code(
      "class Big:\n"
      "    def _repr_html_(self): return '<b>' + 'y' * (400 * 1024) + '</b>'\n"
      "    def __repr__(self): return 'Big()'\n"
      "Big()");
  ASSERT_EQ(types(display), (std::vector<std::string>{"result", "end"}));
  EXPECT_FALSE(display[0]["data"].contains("text/html"));
  EXPECT_NE(display[0]["data"]["text/plain"].get<std::string>().find("text/html output of"), std::string::npos)
      << display[0]["data"]["text/plain"];

  // At most 1 MiB of output per run: the rest is dropped, the run goes on, the end event says so.
  auto flood = run_code("import os\nfor i in range(3000):\n    print('z' * 1000)\nos.system('head -c 100000 /dev/zero')\n'done'");
  size_t bytes = 0;
  for (const json& e : flood) bytes += e.dump().size() + 1;
  EXPECT_LE(bytes, 1024u * 1024 + 1024);
  EXPECT_EQ(flood.back().value("output_truncated", false), true);
  EXPECT_EQ(types(run_code("print('small')")), (std::vector<std::string>{"stdout", "end"})) << "the next run is whole";
}

TEST_F(CodeTest, ObjectsWithReprMethodsBecomeRichDisplays) {
  auto e = run_code(
      "import base64\n"
      "PNG = base64.b64decode('iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYPj/HwADAgH/jnLpHQAAAABJRU5ErkJggg==')\n"
      "class Pic:\n"
      "    def _repr_png_(self): return PNG\n"
      "class Table:\n"
      "    def _repr_html_(self): return '<table><tr><td>1</td></tr></table>'\n"
      "    def _repr_json_(self): return {'rows': 1}\n"
      "class Bundle:\n"
      "    def _repr_mimebundle_(self, include=None, exclude=None): return {'text/markdown': '**hi**'}\n"
      "class Broken:\n"
      "    def _repr_html_(self): raise ValueError('no html')\n"
      "    def __repr__(self): return 'Broken()'\n"
      "display(Pic())\n"
      "display(Bundle(), Broken())\n"
      "Table()");
  ASSERT_EQ(types(e), (std::vector<std::string>{"display", "display", "stderr", "display", "result", "end"}))
      << json(e).dump();
  std::string png = base64_decode(e[0]["data"]["image/png"].get<std::string>());
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_TRUE(e[0]["data"].contains("text/plain"));
  EXPECT_EQ(e[1]["data"]["text/markdown"], "**hi**");
  EXPECT_NE(e[2]["data"].get<std::string>().find("_repr_html_ raised ValueError"), std::string::npos);
  EXPECT_EQ(e[3]["data"], (json{{"text/plain", "Broken()"}}));
  EXPECT_EQ(e[4]["data"]["text/html"], "<table><tr><td>1</td></tr></table>");
  EXPECT_EQ(e[4]["data"]["application/json"], (json{{"rows", 1}}));
}

TEST_F(CodeTest, AClientThatGoesAwayInterruptsItsRunButNotTheContext) {
  run_code("here = True");
  Ran r = run("curl -sS -N --max-time 1 " + kJson + "-d '{\"code\":\"import time\\ntime.sleep(60)\"}' " + url("/run_code"));
  EXPECT_NE(r.status, 0) << "curl should have given up";
  EXPECT_TRUE(eventually([&] { return context_info("default").value("state", "") == "idle"; }))
      << context_info("default");
  EXPECT_EQ(run_code("here")[0]["data"]["text/plain"], "True");
}

// Debian's pandas and matplotlib (test dependencies in deploy/install-deps.sh), as a data-analysis session
// would use them.
TEST_F(CodeTest, PandasDataFrameAcrossCallsAndAMatplotlibPlotAsPng) {
  std::string csv = write_file("sales.csv", "city,sales\nParis,10\nLyon,7\nNice,12\n");
  auto load = run_code("import pandas as pd\ndf = pd.read_csv('" + csv + "')\nprint(len(df))");
  ASSERT_EQ(types(load), (std::vector<std::string>{"stdout", "end"})) << json(load).dump();
  EXPECT_EQ(text_of(load, "stdout"), "3\n");

  auto use = run_code("df['sales'].sum()");
  ASSERT_EQ(types(use), (std::vector<std::string>{"result", "end"}));
  EXPECT_EQ(use[0]["data"]["text/plain"], "29");

  auto table = run_code("df.sort_values('sales', ascending=False)");
  ASSERT_EQ(types(table), (std::vector<std::string>{"result", "end"}));
  std::string html = table[0]["data"]["text/html"];
  EXPECT_NE(html.find("<table"), std::string::npos) << html;
  EXPECT_LT(html.find("Nice"), html.find("Lyon")) << html;
  EXPECT_NE(table[0]["data"]["text/plain"].get<std::string>().find("Paris"), std::string::npos);

  // A figure left open at the end of the run, and one shown with plt.show() mid-run: both arrive as PNGs,
  // the shown one before what the code printed after it.
  auto plots = run_code(
      "import matplotlib.pyplot as plt\n"
      "fig = plt.figure(figsize=(4, 3), dpi=50)\n"
      "plt.bar(df['city'], df['sales'])\n"
      "plt.show()\n"
      "print('between')\n"
      "fig2, ax = plt.subplots(figsize=(2, 2), dpi=50)\n"
      "ax.plot([1, 2, 3]);  # ';': no result, as in IPython\n");
  ASSERT_EQ(types(plots), (std::vector<std::string>{"display", "stdout", "display", "end"})) << json(plots).dump();
  for (int i : {0, 2}) {
    std::string png = base64_decode(plots[i]["data"]["image/png"].get<std::string>());
    ASSERT_GT(png.size(), 33u);
    EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
    EXPECT_EQ(png.substr(12, 4), "IHDR");
    uint32_t width = be32(png, 16), height = be32(png, 20);
    // bbox_inches='tight' trims the margins: a little under figsize * dpi.
    uint32_t want_w = i == 0 ? 200 : 100, want_h = i == 0 ? 150 : 100;
    EXPECT_GT(width, want_w / 2);
    EXPECT_LE(width, want_w + 10);
    EXPECT_GT(height, want_h / 2);
    EXPECT_LE(height, want_h + 10);
  }
  EXPECT_EQ(text_of(plots, "stdout"), "between\n");
  EXPECT_EQ(run_code("len(plt.get_fignums())")[0]["data"]["text/plain"], "0") << "shown figures are closed";
}

}  // namespace
}  // namespace sg::agent
