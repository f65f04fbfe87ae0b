// The ingress's TLS configuration as a scanner and real clients see it: TLS 1.2 and 1.3 only, TLS 1.2 with
// ECDHE + AEAD suites only, HSTS on the edge's own answers, and testssl.sh (Debian's `testssl.sh`) finding no
// weak protocol, cipher or known vulnerability. The full scan (every check, about 5 minutes here) is
// bench/testssl.py; this test runs the checks that bear on the configuration, in about 30 s.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>

#include <nlohmann/json.hpp>

#include "tests/e2e/harness.h"

namespace sg::e2e {
namespace {

// openssl s_client with `flags`, SNI api.<domain>, the test CA; exit 0 iff the handshake completed.
CommandResult handshake(const Cluster& c, const std::string& flags) {
  return run("openssl s_client -connect 127.0.0.1:" + std::to_string(c.port()) +
             " -servername api.sandbox.localhost -verify_return_error -CAfile " + shell_quote(c.ca()) + " " +
             flags + " </dev/null 2>&1", 30);
}

TEST(TlsConfig, OnlyTls12AndUpWithAeadSuites) {
  Cluster c;
  EXPECT_EQ(handshake(c, "-tls1_3").exit_code, 0);
  EXPECT_EQ(handshake(c, "-tls1_2 -cipher ECDHE-ECDSA-AES128-GCM-SHA256").exit_code, 0);
  EXPECT_EQ(handshake(c, "-tls1_2 -cipher ECDHE-ECDSA-CHACHA20-POLY1305").exit_code, 0);
  // CBC with HMAC (Lucky13's target) and anything below TLS 1.2 are refused.
  for (const char* cbc : {"ECDHE-ECDSA-AES128-SHA", "ECDHE-ECDSA-AES256-SHA384", "ECDHE-ECDSA-AES128-SHA256"}) {
    auto r = handshake(c, std::string("-tls1_2 -cipher ") + cbc);
    EXPECT_NE(r.exit_code, 0) << cbc << " was accepted: " << r.out;
  }
  EXPECT_NE(handshake(c, "-tls1_1 -cipher DEFAULT@SECLEVEL=0").exit_code, 0);
}

TEST(TlsConfig, TheEdgesOwnAnswersCarryHsts) {
  Cluster c;
  for (const char* http : {"--http1.1", "--http2"}) {
    auto r = c.curl("8080-nosuch.sandbox.localhost", "/", std::string("-D - ") + http);
    EXPECT_EQ(Cluster::http_code(r), 404) << r.out << r.err;
    std::string head = r.out;
    std::transform(head.begin(), head.end(), head.begin(), [](unsigned char ch) { return std::tolower(ch); });
    EXPECT_NE(head.find("\nstrict-transport-security: max-age=31536000"), std::string::npos) << http << ": " << r.out;
  }
}

TEST(TlsConfig, TestsslFindsNoWeakProtocolCipherOrVulnerability) {
  ASSERT_EQ(run("command -v testssl").exit_code, 0) << "testssl is missing: deploy/install-deps.sh installs testssl.sh";
  Cluster c;
  const std::string json = c.dir() + "/testssl.json";
  // -p protocols, -s cipher categories, -h headers, -H Heartbleed, -I CCS, -R renegotiation, -C CRIME,
  // -T Ticketbleed, -O POODLE, -Z fallback SCSV, -W SWEET32, -A BEAST, -L LUCKY13, -4 RC4. Left out (the
  // full scan runs them): ROBOT, DROWN, FREAK, LOGJAM (no RSA key exchange, no export or DH suites).
  auto r = run("HOME=" + shell_quote(c.dir()) + " testssl --quiet --color 0 --warnings off --ip 127.0.0.1 --add-ca " +
                   shell_quote(c.ca()) + " --jsonfile " + shell_quote(json) +
                   " -p -s -h -H -I -R -C -T -O -Z -W -A -L -4 api.sandbox.localhost:" + std::to_string(c.port()),
               600);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  auto findings = nlohmann::json::parse(read_file(json), nullptr, false);
  ASSERT_TRUE(findings.is_array()) << read_file(json);
  size_t checked = 0;
  for (const auto& f : findings) {
    const std::string id = f.value("id", ""), severity = f.value("severity", ""), finding = f.value("finding", "");
    ++checked;
    // A certificate from a local CA has no revocation endpoint; a production certificate brings its own.
    if (id == "cert_revocation" || id == "DNS_CAArecord") continue;
    // About the machine running testssl (its openssl has no GOST engine), not about the proxy: seen on a
    // fresh Debian 12 machine in a clean-clone CI run.
    if (id == "engine_problem") continue;
    EXPECT_TRUE(severity == "OK" || severity == "INFO") << id << " " << severity << ": " << finding;
    if (id == "TLS1" || id == "TLS1_1" || id == "SSLv2" || id == "SSLv3") {
      EXPECT_EQ(finding, "not offered") << id;
    }
  }
  EXPECT_GT(checked, 30u) << "testssl reported too little to have scanned: " << r.out;
}

// A TLS 1.3 connection leaves OpenSSL for the proxy's own record layer (docs/architecture.md), and a real
// client (openssl s_client) goes on over it, with a KeyUpdate that asks for the proxy's, a download, an
// upload and a last request, and the access log says which path it ended on. For each suite the layer has.
TEST(TlsRecords, AConnectionGoesOnThroughTheProxysOwnRecordLayer) {
  for (const char* suite : {"TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"}) {
    Cluster c(ClusterOptions::proxy("metrics_listen = [\"127.0.0.1:0\"]\n"));
    const uint16_t metrics = c.metrics_port();
    ASSERT_NE(metrics, 0);
    c.create_http_sandbox("web", 8080);
    c.wait_until_serving("web", 8080);
    auto r = run("/usr/bin/python3 " + source("tests/e2e/tools/tls_records_client.py") + " 127.0.0.1 " +
                     std::to_string(c.port()) + " 8080-web.sandbox.localhost " + shell_quote(c.ca()) +
                     " http://127.0.0.1:" + std::to_string(metrics) + "/metrics " + suite,
                 90);
    EXPECT_EQ(r.out, "ok\n") << suite << ": " << r.err;
    // The connection that carried the download (the probes of wait_until_serving took the own layer too).
    auto entry = c.wait_access_entry([](const nlohmann::json& e) {
      return e.value("sni", "") == "8080-web.sandbox.localhost" && e.value("bytes_out", 0) >= 300000;
    });
    EXPECT_EQ(entry.value("path", ""), "own-records") << suite << ": " << entry.dump();
    EXPECT_EQ(entry.value("cause", ""), "client_closed") << suite << ": " << entry.dump();
  }
}

}  // namespace
}  // namespace sg::e2e
