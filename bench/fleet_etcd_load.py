#!/usr/bin/env python3
"""etcd load of a fleet at 10,000 sandboxes and their state changes (issue 13; results in bench/RESULTS.md).

    bench/fleet_etcd_load.py BUILD_DIR [SANDBOXES] [SECONDS] [RATES]   (defaults 10000, 20, "0,50,200,max";
                                                                        run as root)

One real etcd member (Debian's etcd 3.4, plain HTTP on loopback), one real sandgate-node and sandgate-proxy in
the fleet (the node registers and follows the fleet with its directory, the proxy routes from its own), and
SANDBOXES sandbox keys spread over ten stand-in nodes, written as the nodes write them (docs/fleet.md: the
owner, the state and the ports). Then, for each rate, SECONDS of state changes (running <-> suspended) on
random sandboxes, each written the way a node writes a state: a range of the key, then a txn guarded by its
mod_revision (fleet_member.cc, write_state). "max" is as fast as 4 writer threads go.

Measured per phase: the state changes done per second, the CPU of etcd, the node and the proxy (utime +
stime from /proc, in % of one core), their RSS at the end, etcd's database size, and how long a new sandbox
key takes to be routed by the proxy under that load (a marker key put every 0.5 s; the proxy polled with TLS
connections until its answer is no longer the 404 of an unknown sandbox: the stand-in nodes cannot be
reached, so a routed request gets 503). Also: the bulk load of the keys, the proxy's catch-up after it, and
a proxy restart (a list of every key) with the keys in place.
"""
import base64
import json
import os
import random
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import threading
import time
import http.client

from sgbench import DOMAIN, ROOT, Cluster, stop, wait_for

FAKE_NODES = 10
CLK_TCK = os.sysconf("SC_CLK_TCK")


def b64(s):
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    """The v3 JSON gateway, one keep-alive connection per thread."""

    def __init__(self, port):
        self.port = port
        self.local = threading.local()

    def call(self, path, body):
        conn = getattr(self.local, "conn", None)
        for attempt in range(2):
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                self.local.conn = conn
            try:
                conn.request("POST", "/v3/" + path, body=json.dumps(body), headers={"Content-Type": "application/json"})
                r = conn.getresponse()
                data = r.read()
                if r.status != 200:
                    raise RuntimeError(f"etcd {path}: {r.status} {data[:200]!r}")
                return json.loads(data)
            except (http.client.HTTPException, OSError):
                conn.close()
                conn = None
                self.local.conn = None
                if attempt == 1:
                    raise

    def put(self, key, value):
        return self.call("kv/put", {"key": b64(key), "value": b64(value)})

    def put_many(self, items):
        return self.call("kv/txn", {"success": [{"request_put": {"key": b64(k), "value": b64(v)}} for k, v in items]})

    def write_state(self, key, value):
        """As a node writes a state: a range, then a txn on the mod_revision it read."""
        got = self.call("kv/range", {"key": b64(key)})
        kvs = got.get("kvs", [])
        mod = int(kvs[0]["mod_revision"]) if kvs else 0
        cmp = [{"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod)}] if kvs else \
              [{"key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}]
        return self.call("kv/txn", {"compare": cmp, "success": [{"request_put": {"key": b64(key), "value": b64(value)}}]})

    def db_size(self):
        return int(self.call("maintenance/status", {}).get("dbSize", 0))


def sandbox_value(node, state):
    return json.dumps({"node": node, "ports": [{"port": 8080, "protocol": "http1", "public": False},
                                               {"port": 9501, "protocol": "h2c", "public": False}],
                       "state": state}, separators=(",", ":"))


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_mib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def routed(port, ctx, name):
    """True once the proxy knows `name` from etcd (anything but the 404 of a sandbox nobody has)."""
    host = f"8080-{name}.{DOMAIN}"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=host) as s:
            s.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            line = s.recv(64)
    return line.startswith(b"HTTP/1.1 ") and not line.startswith(b"HTTP/1.1 404")


def time_to_route(port, ctx, name, started, limit_s=30.0):
    while time.perf_counter() - started < limit_s:
        if routed(port, ctx, name):
            return (time.perf_counter() - started) * 1000
    return float("inf")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    build = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 10000
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 20.0
    rates = (sys.argv[4] if len(sys.argv) > 4 else "0,50,200,max").split(",")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import tempfile
    tmp = tempfile.mkdtemp(prefix="sandgate-fleet-etcd-load.")
    client_port, peer_port, fleet_port = free_port(), free_port(), free_port()
    etcd_proc = subprocess.Popen(
        ["/usr/bin/etcd", "--name", "m1", "--data-dir", tmp + "/etcd",
         "--listen-client-urls", f"http://127.0.0.1:{client_port}",
         "--advertise-client-urls", f"http://127.0.0.1:{client_port}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-cluster", f"m1=http://127.0.0.1:{peer_port}"],
        stdout=open(tmp + "/etcd.log", "w"), stderr=subprocess.STDOUT)
    etcd = Etcd(client_port)
    cluster = None
    try:
        def etcd_up():
            try:
                etcd.db_size()
                return True
            except Exception:
                return False
        wait_for("etcd", etcd_up, 30, etcd_proc, tmp + "/etcd.log")
        subprocess.run([ROOT + "/deploy/gen-fleet-ca.sh", tmp + "/fleet-ca", "local"], check=True,
                       stdout=subprocess.DEVNULL)
        ca = tmp + "/fleet-ca/"
        cluster = Cluster(build, "fleet-etcd-load",
                          proxy_toml=f'fleet_listen = "127.0.0.1:{fleet_port}"\nfleet_cert = "{ca}local.pem"\n'
                                     f'fleet_key = "{ca}local.key"\nfleet_ca = "{ca}fleet-ca.pem"\n',
                          node_toml=f'\n[fleet]\netcd_endpoints = ["http://127.0.0.1:{client_port}"]\n'
                                    f'node_name = "local"\nadvertise_api = "https://127.0.0.1:1"\n'
                                    f'advertise_ingress = "127.0.0.1:{fleet_port}"\n')
        wait_for("node registered", lambda: "fleet: node local registered" in open(cluster.tmp + "/node.log").read(),
                 30, cluster.node, cluster.tmp + "/node.log")
        ctx = ssl.create_default_context(cafile=cluster.ca)
        pids = {"etcd": etcd_proc.pid, "node": cluster.node.pid, "proxy": cluster.proxy.pid}
        rss_before = {k: rss_mib(p) for k, p in pids.items()}

        # The stand-in nodes: registered, but their fleet listeners cannot be reached.
        for i in range(FAKE_NODES):
            etcd.put(f"/sandgate/nodes/f{i}", json.dumps({"name": f"f{i}", "api": "https://127.0.0.1:1",
                                                         "ingress": "127.0.0.1:1", "state": "ready",
                                                         "capacity_sandboxes": 2000, "sandboxes": n // FAKE_NODES}))
        names = [f"sb{k:05d}" for k in range(n)]
        owner = {name: f"f{k % FAKE_NODES}" for k, name in enumerate(names)}
        t0 = time.perf_counter()
        for i in range(0, n, 100):
            etcd.put_many([(f"/sandgate/sandboxes/{name}", sandbox_value(owner[name], "running"))
                           for name in names[i:i + 100]])
        load_s = time.perf_counter() - t0
        caught_up = time_to_route(cluster.port, ctx, names[-1], t0, 120)
        rss_after = {k: rss_mib(p) for k, p in pids.items()}
        print(f"bulk load: {n} sandbox keys in {load_s:.2f} s (txns of 100 puts); the proxy routed the last one "
              f"{caught_up:.0f} ms after the load began; etcd db {etcd.db_size() / 1e6:.1f} MB")
        print("| RSS MiB | etcd | node | proxy |\n|---|--:|--:|--:|")
        print(f"| empty fleet | {rss_before['etcd']:.1f} | {rss_before['node']:.1f} | {rss_before['proxy']:.1f} |")
        print(f"| {n} sandbox keys | {rss_after['etcd']:.1f} | {rss_after['node']:.1f} | {rss_after['proxy']:.1f} |")

        print(f"\n| state changes/s asked | done/s | etcd CPU % | node CPU % | proxy CPU % | new key routed: median ms "
              f"| max ms | etcd RSS MiB | etcd db MB |")
        print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
        for rate in rates:
            stopping = threading.Event()
            done = [0]
            lock = threading.Lock()

            def writer(per_thread):
                rng = random.Random()
                next_at = time.perf_counter()
                while not stopping.is_set():
                    name = rng.choice(names)
                    etcd.write_state(f"/sandgate/sandboxes/{name}",
                                     sandbox_value(owner[name], rng.choice(("running", "suspended"))))
                    with lock:
                        done[0] += 1
                    if per_thread:
                        next_at += 1.0 / per_thread
                        delay = next_at - time.perf_counter()
                        if delay > 0:
                            time.sleep(delay)

            threads = []
            if rate != "0":
                k = 4
                per = 0 if rate == "max" else float(rate) / k
                threads = [threading.Thread(target=writer, args=(per,), daemon=True) for _ in range(k)]
            cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
            started = time.perf_counter()
            for t in threads:
                t.start()
            marks = []
            m = 0
            while time.perf_counter() - started < seconds:
                name = f"mark-{rate}-{m}"
                m += 1
                put_at = time.perf_counter()
                etcd.put(f"/sandgate/sandboxes/{name}", sandbox_value("f0", "running"))
                marks.append(time_to_route(cluster.port, ctx, name, put_at))
                time.sleep(max(0.0, 0.5 - (time.perf_counter() - put_at)))
            stopping.set()
            for t in threads:
                t.join()
            wall = time.perf_counter() - started
            cpu = {k: (cpu_seconds(p) - cpu0[k]) / wall * 100 for k, p in pids.items()}
            print(f"| {rate} | {done[0] / wall:.0f} | {cpu['etcd']:.1f} | {cpu['node']:.1f} | {cpu['proxy']:.1f} | "
                  f"{statistics.median(marks):.1f} | {max(marks):.1f} | {rss_mib(pids['etcd']):.1f} | "
                  f"{etcd.db_size() / 1e6:.1f} |")

        # A proxy restarted with every key in place lists them all before it routes.
        cluster.proxy.send_signal(signal.SIGTERM)
        cluster.proxy.wait(timeout=20)
        log = cluster.tmp + "/proxy-restart.log"
        t0 = time.perf_counter()
        cluster.proxy = cluster._start([cluster.build + "/proxy/sandgate-proxy"], log)
        wait_for("proxy restart", lambda: "ready on" in open(log).read(), 30, cluster.proxy, log)
        line = [l for l in open(log) if "ready on 127.0.0.1:" in l][0]
        port = int(line.split("ready on 127.0.0.1:")[1].split()[0].rstrip(",;"))
        first = time_to_route(port, ctx, names[-1], t0, 60)
        print(f"\nproxy restart with {n} keys: routing the last one {first:.0f} ms after the start "
              f"(proxy RSS then {rss_mib(cluster.proxy.pid):.1f} MiB)")
    finally:
        if cluster is not None:
            cluster.close()
        stop(etcd_proc)
        subprocess.run(["rm", "-rf", tmp])


if __name__ == "__main__":
    main()
