// Reloads and binary upgrades of the proxy under load, with wrk keeping requests flowing: a SIGHUP with a new
// certificate, and `sandgate-proxy --takeover` (proxy/listener_handover.h) taking the running proxy's
// listening sockets. Not one request fails; after a takeover a download in flight finishes on the old
// process, which then exits by itself, and the new one serves. Session tickets issued before either resume
// after it.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <regex>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

// The sandbox's server: HTTP/1.1 keep-alive, `?size=N` bytes, and "Connection: close" in its answer when the
// request asked for it (RFC 9112 §9.6 says a server should; Python's http.server closes without saying so).
constexpr const char* kServer = R"(
import http.server, urllib.parse
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        q = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
        body = b"x" * int(q.get("size", ["100"])[0])
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", 8080), H).serve_forever()
)";

// wrk for `seconds` in the background against `url`, its report in DIR/wrk.out once DIR/wrk.rc exists.
void start_wrk(const std::string& dir, const std::string& url, int seconds) {
  // wrk connects to 127.0.0.1 whatever the URL's host, which gives SNI and Host.
  write_file(dir + "/loopback.lua",
             "wrk.resolve = function(host, service) wrk.addrs = wrk.lookup(\"127.0.0.1\", service) end\n");
  run("(wrk -t1 -c8 -d" + std::to_string(seconds) + "s -s " + shell_quote(dir + "/loopback.lua") + " " +
      shell_quote(url) + " > " + shell_quote(dir + "/wrk.out") + " 2>&1; echo $? > " + shell_quote(dir + "/wrk.rc") +
      ") >/dev/null 2>&1 &");
}

// Waits for wrk's report and checks it: many requests, no socket error, no answer but 2xx/3xx.
void expect_wrk_saw_no_failure(const std::string& dir) {
  ASSERT_TRUE(eventually([&] { return read_file(dir + "/wrk.rc") != ""; }, std::chrono::seconds(60)));
  const std::string report = read_file(dir + "/wrk.out");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(report, m, std::regex(R"((\d+) requests in)"))) << report;
  EXPECT_GT(std::stoi(m[1].str()), 100) << report;
  EXPECT_EQ(report.find("Socket errors"), std::string::npos) << report;
  EXPECT_EQ(report.find("Non-2xx"), std::string::npos) << report;
}

std::string served_fingerprint(const Cluster& c) {
  return run("openssl s_client -connect 127.0.0.1:" + std::to_string(c.port()) +
             " -servername 8080-web.sandbox.localhost </dev/null 2>/dev/null | openssl x509 -noout -fingerprint -sha256")
      .out;
}

// One request over a new TLS 1.3 connection with openssl s_client, which saves the session (its ticket) in
// `session` or offers the one saved there; "New" or "Reused" as s_client says, "" if it printed neither.
std::string tls13_session(const Cluster& c, const std::string& session, bool offer) {
  auto r = run("printf 'GET / HTTP/1.1\\r\\nHost: 8080-web.sandbox.localhost\\r\\nConnection: close\\r\\n\\r\\n' | "
               "timeout 10 openssl s_client -tls1_3 -ign_eof -connect 127.0.0.1:" + std::to_string(c.port()) +
               " -servername 8080-web.sandbox.localhost " + (offer ? "-sess_in " : "-sess_out ") + shell_quote(session) +
               " 2>/dev/null");
  std::smatch m;
  if (!std::regex_search(r.out, m, std::regex(R"(\n(New|Reused), TLSv1\.3)"))) return "";
  return m[1].str();
}

TEST(Handover, ReloadWithANewCertificateUnderLoadFailsNoRequest) {
  Cluster c;
  auto created = c.cli("create --name web --public 8080 -- python3 -c " + shell_quote(kServer));
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err;
  c.wait_until_serving("web", 8080);
  const std::string before = served_fingerprint(c);
  ASSERT_NE(before, "");
  ASSERT_EQ(tls13_session(c, c.dir() + "/session.pem", false), "New");
  start_wrk(c.dir(), "https://8080-web.sandbox.localhost:" + std::to_string(c.port()) + "/", 4);
  c.wait_access_entry([](const nlohmann::json& e) { return e.value("bytes_out", 0) > 0; });
  // A new server certificate from the same CA (gen-cert.sh keeps a valid CA), then SIGHUP.
  run("rm " + shell_quote(c.dir() + "/tls/server.pem") + " " + shell_quote(c.dir() + "/tls/server.key"));
  ASSERT_EQ(run("bash " + std::string(SANDGATE_SOURCE_DIR) + "/deploy/gen-cert.sh " + shell_quote(c.dir() + "/tls") +
                " sandbox.localhost").exit_code, 0);
  const size_t mark = c.proxy().log().size();
  ::kill(c.proxy().pid(), SIGHUP);
  ASSERT_FALSE(c.proxy().wait_for("config reloaded", 5000, mark).empty()) << c.proxy().log();
  expect_wrk_saw_no_failure(c.dir());
  const std::string after = served_fingerprint(c);
  EXPECT_NE(after, "");
  EXPECT_NE(after, before) << "the new certificate is served after the reload";
  EXPECT_EQ(Cluster::http_code(c.curl("8080-web.sandbox.localhost")), 200) << "it verifies against the CA";
  EXPECT_EQ(tls13_session(c, c.dir() + "/session.pem", true), "Reused")
      << "a session ticket issued before the reload resumes after it (the ticket keys are the process's)";
  // The access log says so too.
  c.wait_access_entry([](const nlohmann::json& e) { return e.value("tls_resumed", false); });
}

TEST(Handover, ANewProcessTakesTheListenersUnderLoadWithNoFailedRequest) {
  Cluster c(ClusterOptions::proxy("handover_socket = \"handover.sock\"\ndrain_timeout_secs = 60\n"));
  auto created = c.cli("create --name web --public 8080 -- python3 -c " + shell_quote(kServer));
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err;
  c.wait_until_serving("web", 8080);
  const std::string dir = c.dir();
  const std::string url = "https://8080-web.sandbox.localhost:" + std::to_string(c.port());

  // A download slow enough (about 3 s) to be in flight on the old process when it hands over.
  const size_t download_bytes = 3'000'000;
  run("(curl -sS --max-time 60 --cacert " + shell_quote(c.ca()) + " --resolve 8080-web.sandbox.localhost:" +
      std::to_string(c.port()) + ":127.0.0.1 --limit-rate 1M -o " + shell_quote(dir + "/download") + " " +
      shell_quote(url + "/?size=" + std::to_string(download_bytes)) + "; echo $? > " + shell_quote(dir + "/download.rc") +
      ") >/dev/null 2>&1 &");
  ASSERT_EQ(tls13_session(c, dir + "/session.pem", false), "New");
  start_wrk(dir, url + "/", 6);
  // Under load before the takeover: the old process has answered requests.
  c.wait_access_entry([](const nlohmann::json& e) { return e.value("bytes_out", 0) > 0; });

  Daemon next;
  ASSERT_TRUE(next.start({std::string(SANDGATE_BIN_DIR) + "/proxy/sandgate-proxy", "--config", c.config_path(), "--takeover"},
                         dir + "/proxy-next.log"));
  EXPECT_NE(next.wait_for("sandgate-proxy ready", 15000), "") << next.log();
  EXPECT_NE(next.wait_for("the previous process stopped accepting", 15000), "") << next.log();

  // The old process finishes the download, then exits on its own.
  const int status = c.proxy().wait_exit(30'000);
  ASSERT_NE(status, -1) << "the old proxy did not exit after draining:\n" << c.proxy().log();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_NE(read_file(dir + "/proxy.log").find("drained: every connection finished"), std::string::npos)
      << read_file(dir + "/proxy.log");
  ASSERT_TRUE(eventually([&] { return read_file(dir + "/download.rc") != ""; }, std::chrono::seconds(30)));
  EXPECT_EQ(read_file(dir + "/download.rc"), "0\n");
  EXPECT_EQ(read_file(dir + "/download").size(), download_bytes);

  expect_wrk_saw_no_failure(dir);

  // The new process serves on the same port, and can itself be taken over (it holds the handover socket).
  auto after = run("curl -sS -o /dev/null -w '%{http_code}' --cacert " + shell_quote(c.ca()) + " --resolve 8080-web.sandbox.localhost:" +
                   std::to_string(c.port()) + ":127.0.0.1 " + shell_quote(url + "/"));
  EXPECT_EQ(after.out, "200") << after.err;
  EXPECT_EQ(tls13_session(c, dir + "/session.pem", true), "Reused")
      << "a session ticket the old process issued resumes on the new one (the keys came with the listeners)";
  EXPECT_NE(next.log().find("handover socket"), std::string::npos) << next.log();
  next.stop();
}

// proxy.tls_ticket_key_file: another proxy process reading the same key file (another node's proxy; here the
// same port after a restart, where keys of the process's own would not read the ticket) resumes the first's
// tickets. A key file others can read stops a start and fails a reload, which keeps serving.
TEST(Handover, AProxyReadingTheSameTicketKeyFileResumesAnothersTickets) {
  ClusterOptions opts = ClusterOptions::proxy("tls_ticket_key_file = \"ticket.keys\"\n");
  opts.start_proxy = false;
  Cluster c(opts);
  const std::string keys = c.dir() + "/ticket.keys";
  ASSERT_EQ(run("(umask 077; openssl rand 80 | base64 -w0 > " + shell_quote(keys) + ")").exit_code, 0);
  c.start_proxy();
  auto created = c.cli("create --name web --public 8080 -- python3 -c " + shell_quote(kServer));
  ASSERT_EQ(created.exit_code, 0) << created.out << created.err;
  c.wait_until_serving("web", 8080);
  ASSERT_EQ(tls13_session(c, c.dir() + "/session.pem", false), "New");
  ASSERT_EQ(tls13_session(c, c.dir() + "/second.pem", false), "New");

  c.stop_proxy();
  c.start_proxy();
  EXPECT_EQ(tls13_session(c, c.dir() + "/session.pem", true), "Reused")
      << "a new process reading the same key file reads the ticket";

  // Another key file (another fleet's keys): a full handshake, not a failure.
  ASSERT_EQ(run("(umask 077; openssl rand 80 | base64 -w0 > " + shell_quote(keys) + ")").exit_code, 0);
  size_t mark = c.proxy().log().size();
  ::kill(c.proxy().pid(), SIGHUP);
  ASSERT_FALSE(c.proxy().wait_for("config reloaded", 5000, mark).empty()) << c.proxy().log();
  EXPECT_EQ(tls13_session(c, c.dir() + "/second.pem", true), "New");

  ASSERT_EQ(::chmod(keys.c_str(), 0644), 0);
  mark = c.proxy().log().size();
  ::kill(c.proxy().pid(), SIGHUP);
  const std::string refused = c.proxy().wait_for("reload failed", 5000, mark);
  EXPECT_NE(refused.find("proxy.tls_ticket_key_file: " + keys + " has mode 0644"), std::string::npos)
      << c.proxy().log();
  EXPECT_EQ(Cluster::http_code(c.curl("8080-web.sandbox.localhost")), 200) << "still serving";
  c.stop_proxy();
  Daemon refusing;
  ASSERT_TRUE(refusing.start({std::string(SANDGATE_BIN_DIR) + "/proxy/sandgate-proxy", "--config", c.config_path()},
                             c.dir() + "/proxy-refusing.log"));
  const int status = refusing.wait_exit(10'000);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
  EXPECT_NE(refusing.log().find("chmod 600 " + keys), std::string::npos) << refusing.log();
}

TEST(Handover, TakeoverWithoutARunningProxyFailsClearly) {
  Cluster c(ClusterOptions::proxy("handover_socket = \"handover.sock\"\n"));
  c.stop_proxy();
  auto r = run(std::string(SANDGATE_BIN_DIR) + "/proxy/sandgate-proxy --config " + shell_quote(c.config_path()) +
               " --takeover 2>&1");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("no proxy to take over at"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace sg::e2e
