// run_code through the ingress, as an SDK would call it: `https://<name>.<domain>/run_code` with the sandbox's
// token, curl reading the NDJSON stream as it comes (HTTP/1.1 and h2), the interpreter's state kept across
// calls and across a suspend and resume (the sandbox's processes are frozen, not restarted).
#include <gtest/gtest.h>

#include <sstream>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

using nlohmann::json;

std::vector<json> events_of(const CommandResult& r) {
  std::vector<json> events;
  std::istringstream lines(Cluster::body(r));
  std::string line;
  while (std::getline(lines, line))
    if (!line.empty()) events.push_back(json::parse(line, nullptr, false));
  return events;
}

std::string summary(const std::vector<json>& events) {
  std::string out;
  for (const json& e : events) {
    out += e.value("type", "?");
    if (e.contains("data") && e["data"].is_string()) out += ":" + e["data"].get<std::string>();
    if (e.contains("data") && e["data"].is_object()) out += ":" + e["data"].value("text/plain", "");
    if (e.contains("name")) out += ":" + e["name"].get<std::string>();
    out += "|";
  }
  return out;
}

CommandResult run_code(Cluster& c, const std::string& name, const std::string& token, const json& body,
                       const std::string& proto = "--http1.1") {
  return c.curl(name + ".sandbox.localhost", "/run_code",
                proto + " -N -X POST -H 'Content-Type: application/json' --data " + shell_quote(body.dump()) + " " +
                    bearer(token),
                60);
}

TEST(CodeInterpreter, StateAcrossCallsThroughTheIngressAndAcrossSuspendResume) {
  Cluster c;
  json box = create_with_agent(c, "py", "--timeout 600 -- /bin/sleep 3600");
  ASSERT_TRUE(box.contains("token"));
  const std::string token = box["token"];

  // Without the token the edge refuses before the agent sees anything.
  auto refused = c.curl("py.sandbox.localhost", "/run_code",
                        "-X POST -H 'Content-Type: application/json' --data '{\"code\":\"1\"}'");
  EXPECT_EQ(Cluster::http_code(refused), 401);

  // A context of its own, then two runs sharing a name; the events keep the order the code wrote them in.
  auto made = c.curl("py.sandbox.localhost", "/contexts",
                     "-X POST -H 'Content-Type: application/json' --data '{\"language\":\"python\"}' " + bearer(token));
  ASSERT_EQ(Cluster::http_code(made), 201) << made.out << made.err;
  const std::string ctx = json::parse(Cluster::body(made), nullptr, false).value("id", "");
  ASSERT_FALSE(ctx.empty()) << made.out;

  auto first = run_code(c, "py", token,
                        {{"context", ctx},
                         {"code",
                          "import sys, time\n"
                          "rows = [('a', 1), ('b', 2)]\n"
                          "print('one')\n"
                          "print('two', file=sys.stderr)\n"
                          "time.sleep(0.2)\n"
                          "print('three')\n"
                          "len(rows)"}});
  ASSERT_EQ(Cluster::http_code(first), 200) << first.out << first.err;
  EXPECT_EQ(summary(events_of(first)), "stdout:one\n|stderr:two\n|stdout:three\n|result:2|end|") << first.out;

  for (const std::string proto : {"--http1.1", "--http2"}) {
    auto second = run_code(c, "py", token, {{"context", ctx}, {"code", "rows.append(('c', 3))\nsum(v for _, v in rows)"}},
                           proto);
    ASSERT_EQ(Cluster::http_code(second), 200) << second.out << second.err;
    auto ev = events_of(second);
    ASSERT_EQ(ev.size(), 2u) << second.out;
    EXPECT_EQ(ev[0]["type"], "result");
    EXPECT_EQ(ev.back()["type"], "end");
    EXPECT_EQ(ev.back()["context"], ctx);
  }
  // Twice appended: 1 + 2 + 3 + 3.
  auto total = run_code(c, "py", token, {{"context", ctx}, {"code", "sum(v for _, v in rows)"}});
  EXPECT_EQ(summary(events_of(total)), "result:9|end|") << total.out;

  // An error comes back structured, and the context lives on.
  auto err = run_code(c, "py", token, {{"context", ctx}, {"code", "rows[10]"}});
  auto err_events = events_of(err);
  ASSERT_EQ(summary(err_events), "error:IndexError|end|") << err.out;
  EXPECT_EQ(err_events[0]["message"], "list index out of range");
  EXPECT_GE(err_events[0]["traceback"].size(), 2u);

  // Suspend freezes the interpreter with the rest of the sandbox; the next run_code wakes it, state intact.
  auto s = c.cli("suspend py");
  ASSERT_EQ(s.exit_code, 0) << s.out << s.err;
  ASSERT_TRUE(eventually([&] { return c.get("py")["state"] == "suspended"; }, std::chrono::seconds(10)));
  ASSERT_TRUE(c.cgroup_frozen(box["id"]));
  auto woke = run_code(c, "py", token, {{"context", ctx}, {"code", "print(len(rows))\nrows[-1][0]"}});
  ASSERT_EQ(Cluster::http_code(woke), 200) << woke.out << woke.err;
  EXPECT_EQ(summary(events_of(woke)), "stdout:4\n|result:'c'|end|") << woke.out;

  // And after an explicit resume, with the default context created on first use next to it.
  s = c.cli("suspend py");
  ASSERT_EQ(s.exit_code, 0) << s.out << s.err;
  ASSERT_TRUE(eventually([&] { return c.get("py")["state"] == "suspended"; }, std::chrono::seconds(10)));
  s = c.cli("resume py");
  ASSERT_EQ(s.exit_code, 0) << s.out << s.err;
  auto again = run_code(c, "py", token, {{"context", ctx}, {"code", "len(rows)"}});
  EXPECT_EQ(summary(events_of(again)), "result:4|end|") << again.out;
  auto dflt = run_code(c, "py", token, {{"code", "'rows' in globals()"}});
  EXPECT_EQ(summary(events_of(dflt)), "result:False|end|") << dflt.out;
  auto list = c.curl("py.sandbox.localhost", "/contexts", bearer(token));
  EXPECT_EQ(json::parse(Cluster::body(list), nullptr, false)["contexts"].size(), 2u) << list.out;
}

}  // namespace
}  // namespace sg::e2e
