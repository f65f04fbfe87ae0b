// Real etcd members for tests (Debian's /usr/bin/etcd): a cluster of N members on loopback ports the kernel
// picked, data and logs in the test's own directory. Shared by the unit tests (common/etcd_client) and the
// e2e tests (fleet). Header-only like tests/netns.h.
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/etcd_client.h"
#include "common/net.h"

namespace sg::testing {

// Polls `pred` every 20 ms until it holds or `timeout` passes.
template <typename Pred>
bool wait_until(Pred pred, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (pred()) return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

inline bool have_etcd() { return ::access("/usr/bin/etcd", X_OK) == 0; }

// A free loopback TCP port (the kernel's pick; released before etcd binds it, which is racy only against
// another process taking the same port in between).
inline uint16_t free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  (void)::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa);
  socklen_t len = sizeof sa;
  (void)::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  ::close(fd);
  return ntohs(sa.sin_port);
}

// A CA, a member certificate for 127.0.0.1 (IP SAN) and the name "etcd.test" (DNS SAN), a client
// certificate, and a second CA that signed none of them, made with the openssl CLI in `dir`:
// ca.pem, member.pem/.key, client.pem/.key, other-ca.pem. False when openssl failed.
inline bool make_etcd_pki(const std::string& dir) {
  const std::string script = R"SH(set -e
cd "$1"
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1"; }
for ca in ca other-ca; do
  key $ca.key
  openssl req -new -x509 -key $ca.key -subj "/CN=sandgate test $ca" -days 2 -out $ca.pem \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign
done
sign() {  # NAME EXTENDED_KEY_USAGE [SUBJECT_ALT_NAME]
  key $1.key
  openssl req -new -key $1.key -subj "/CN=$1" -out $1.csr
  { echo "extendedKeyUsage=$2"; [ -z "$3" ] || echo "subjectAltName=$3"; } >$1.ext
  openssl x509 -req -in $1.csr -CA ca.pem -CAkey ca.key -set_serial 0x$(openssl rand -hex 8) -days 2 \
    -extfile $1.ext -out $1.pem
}
sign member serverAuth,clientAuth IP:127.0.0.1,DNS:etcd.test  # etcd's gateway dials itself with it
sign client clientAuth
)SH";
  const std::string path = dir + "/make-pki.sh";
  std::ofstream(path) << script;
  const std::string cmd = "bash '" + path + "' '" + dir + "' >'" + dir + "/make-pki.log' 2>&1";
  return std::system(cmd.c_str()) == 0;
}

class EtcdCluster {
 public:
  // `dir` must exist; member i keeps its data in dir/etcd-i and logs to dir/etcd-i.log. The members run in the
  // network namespace at `netns` (a /proc/PID/ns/net path; "" = this one) and listen on `host`. With `pki`
  // (a make_etcd_pki directory) clients reach them over https:// with a client certificate, which they
  // require (--client-cert-auth).
  EtcdCluster(std::string dir, int members, std::string netns = "", std::string host = "127.0.0.1",
              std::string pki = "")
      : dir_(std::move(dir)), netns_(std::move(netns)), host_(std::move(host)), pki_(std::move(pki)) {
    std::string initial;
    for (int i = 0; i < members; i++) {
      Member m;
      m.name = "m" + std::to_string(i);
      m.client_port = free_port();
      m.peer_port = free_port();
      initial += (initial.empty() ? "" : ",") + m.name + "=http://" + host_ + ":" + std::to_string(m.peer_port);
      members_.push_back(m);
    }
    initial_cluster_ = initial;
  }
  ~EtcdCluster() {
    for (size_t i = 0; i < members_.size(); i++) stop(i, SIGKILL);
  }
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  // Starts every member and waits (with a deadline) until the cluster answers a range.
  bool start_all() {
    for (size_t i = 0; i < members_.size(); i++)
      if (!start(i)) return false;
    return wait_ready(std::chrono::seconds(20));
  }

  bool start(size_t i) {
    Member& m = members_[i];
    if (m.pid > 0) return true;
    std::string data = dir_ + "/etcd-" + std::to_string(i);
    std::string log = data + ".log";
    std::string client = url(i);
    std::string peer = "http://" + host_ + ":" + std::to_string(m.peer_port);
    std::vector<std::string> argv = {"/usr/bin/etcd", "--name", m.name, "--data-dir", data,
                                     "--listen-client-urls", client, "--advertise-client-urls", client,
                                     "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                                     "--initial-cluster", initial_cluster_, "--initial-cluster-state", "new",
                                     "--initial-cluster-token", "sandgate-test",
                                     // Short elections keep the failover tests quick.
                                     "--heartbeat-interval", "50", "--election-timeout", "500"};
    if (!pki_.empty()) {
      for (const char* a : {"--cert-file", "member.pem", "--key-file", "member.key", "--trusted-ca-file", "ca.pem"})
        argv.push_back(a[0] == '-' ? std::string(a) : pki_ + "/" + a);
      argv.push_back("--client-cert-auth");
    }
    pid_t pid = ::fork();
    if (pid < 0) return false;
    if (pid == 0) {
      if (!netns_.empty()) {
        int ns = ::open(netns_.c_str(), O_RDONLY | O_CLOEXEC);
        if (ns < 0 || ::setns(ns, CLONE_NEWNET) != 0) ::_exit(126);
      }
      int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
      }
      std::vector<char*> args;
      for (auto& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
    m.pid = pid;
    return true;
  }

  void stop(size_t i, int sig = SIGTERM) {
    Member& m = members_[i];
    if (m.pid <= 0) return;
    ::kill(m.pid, sig);
    int status = 0;
    ::waitpid(m.pid, &status, 0);
    m.pid = -1;
  }
  // SIGSTOP / SIGCONT: a member that holds its connections but answers nothing (a partition, as its peers and
  // clients see it).
  // SIGSTOP takes effect when each of etcd's threads is next scheduled, not when kill() returns, so this
  // waits (up to 5 s) until /proc shows every thread stopped: a request sent after pause() is never answered.
  bool pause(size_t i) {
    if (members_[i].pid <= 0) return false;
    ::kill(members_[i].pid, SIGSTOP);
    const std::string tasks = "/proc/" + std::to_string(members_[i].pid) + "/task";
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (std::chrono::steady_clock::now() < deadline) {
      bool all_stopped = true;
      std::error_code ec;
      for (const auto& task : std::filesystem::directory_iterator(tasks, ec)) {
        std::ifstream stat(task.path() / "stat");
        std::string line;
        std::getline(stat, line);
        size_t close = line.rfind(')');  // the state follows "(comm)", which may hold spaces
        if (close == std::string::npos || close + 2 >= line.size() || (line[close + 2] != 'T' && line[close + 2] != 't'))
          all_stopped = false;
      }
      if (!ec && all_stopped) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }
  void resume(size_t i) { if (members_[i].pid > 0) ::kill(members_[i].pid, SIGCONT); }

  // The member that leads now: the live member whose /v3/maintenance/status names itself as the leader; -1
  // when none does (no quorum, an election under way).
  int leader() const {
    auto id = [](const nlohmann::json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); };
    for (size_t i = 0; i < members_.size(); i++) {
      if (members_[i].pid <= 0) continue;
      std::string cmd = "curl -s -m 2 -X POST -d '{}' " + url(i) + "/v3/maintenance/status";
      if (!pki_.empty())
        cmd += " --cacert " + pki_ + "/ca.pem --cert " + pki_ + "/client.pem --key " + pki_ + "/client.key";
      std::string out;
      if (FILE* p = ::popen(cmd.c_str(), "r")) {
        char buf[4096];
        for (size_t n; (n = ::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
        ::pclose(p);
      }
      auto j = nlohmann::json::parse(out, nullptr, false);
      if (j.is_object() && j.contains("leader") && j.contains("header") && j["header"].contains("member_id") &&
          id(j["leader"]) == id(j["header"]["member_id"]))
        return static_cast<int>(i);
    }
    return -1;
  }

  bool wait_ready(std::chrono::milliseconds timeout) {
    etcd::Client client(options());
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      if (client.range("/ready-probe")) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  std::string url(size_t i) const {
    return (pki_.empty() ? "http://" : "https://") + host_ + ":" + std::to_string(members_[i].client_port);
  }
  // The [fleet] lines a daemon needs for these members' TLS ("" without it).
  std::string tls_config() const {
    if (pki_.empty()) return "";
    return "etcd_cacert = \"" + pki_ + "/ca.pem\"\netcd_cert = \"" + pki_ + "/client.pem\"\netcd_key = \"" + pki_ +
           "/client.key\"\n";
  }
  uint16_t client_port(size_t i) const { return members_[i].client_port; }
  std::vector<std::string> urls() const {
    std::vector<std::string> out;
    for (size_t i = 0; i < members_.size(); i++) out.push_back(url(i));
    return out;
  }
  etcd::ClientOptions options(std::chrono::milliseconds timeout = std::chrono::milliseconds(1000)) const {
    etcd::ClientOptions o;
    for (size_t i = 0; i < members_.size(); i++) o.members.push_back(*etcd::parse_member(url(i)));
    o.timeout = timeout;
    if (!pki_.empty()) o.tls = {pki_ + "/ca.pem", pki_ + "/client.pem", pki_ + "/client.key", ""};
    return o;
  }
  size_t size() const { return members_.size(); }

 private:
  struct Member {
    std::string name;
    uint16_t client_port = 0;
    uint16_t peer_port = 0;
    pid_t pid = -1;
  };
  std::string dir_;
  std::string netns_;
  std::string host_;
  std::string pki_;
  std::string initial_cluster_;
  std::vector<Member> members_;
};

}  // namespace sg::testing
