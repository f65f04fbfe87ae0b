#!/usr/bin/env python3
"""The cross-node hop's cost (issue 13; results in bench/RESULTS.md): added latency and proxy CPU per
connection of a sandbox on another node, reached through this node's proxy, vs a sandbox on this node.

    bench/fleet_hop.py BUILD_DIR [N]      (default 300 connections per path; run as root)
    IMAGES_DIR=DIR IMAGE=NAME  a node images dir holding an image with python3 (default: `default`, built
                               first when missing)

Two node + proxy pairs on loopback (one worker each, userspace TLS), a fleet CA from deploy/gen-fleet-ca.sh,
and proxy A's directory view from proxy.fleet_static_directory_file (the test-only stand-in for etcd). The
sandbox `loc` runs on node A, `rem` on node B, the same small keep-alive HTTP server. Each sample is one new
TLS connection to proxy A (verified against its CA), one GET, the whole response, close: connect to last
byte. Local and remote samples alternate, so both see the same machine. CPU is the proxies' utime+stime
(/proc) over each path's samples, divided by the samples.
"""
import json
import os
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time

from sgbench import DOMAIN, OK_SERVER, ROOT, Cluster, wait_for


def cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_request(port, ctx, host):
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as raw:
        # The request follows the client's Finished at once: without this, Nagle holds it for the ACK that
        # the proxy delays (40 ms), and that would be most of every sample.
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with ctx.wrap_socket(raw, server_hostname=host) as s:
            t_tls = time.perf_counter()
            s.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while not data.endswith(b"ok"):
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
    if not data.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"{host}: {data[:200]!r}")
    t_end = time.perf_counter()
    return (t_end - t0) * 1000, (t_tls - t0) * 1000


def fleet_port(cluster):
    wait_for("fleet listener", lambda: "fleet ingress on 127.0.0.1:" in open(cluster.tmp + "/proxy.log").read(), 10)
    line = [l for l in open(cluster.tmp + "/proxy.log") if "fleet ingress on 127.0.0.1:" in l][0]
    return int(line.split("fleet ingress on 127.0.0.1:")[1].split()[0].rstrip(",;"))


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    image = os.environ.get("IMAGE", "default")
    certs = tempfile.mkdtemp(prefix="sandgate-fleet-certs.")
    subprocess.run([ROOT + "/deploy/gen-fleet-ca.sh", certs, "a", "b"], check=True, stdout=subprocess.DEVNULL)
    clusters = []
    try:
        for node in ("a", "b"):
            directory = f"{certs}/directory-{node}.json"
            with open(directory, "w") as f:
                f.write("{}")
            clusters.append(Cluster(sys.argv[1], f"fleet{node}", f"""fleet_listen = "127.0.0.1:0"
fleet_cert = "{certs}/{node}.pem"
fleet_key = "{certs}/{node}.key"
fleet_ca = "{certs}/fleet-ca.pem"
fleet_static_directory_file = "{directory}"
"""))
        a, b = clusters
        ports = {"a": fleet_port(a), "b": fleet_port(b)}
        for c, name in ((a, "loc"), (b, "rem")):
            if image == "default":
                c.ensure_default_image()
            c.create({"name": name, "image": image, "command": ["python3", "-c", OK_SERVER], "timeout_secs": 3600,
                      "ports": [{"port": 8080, "public": True}]})
        with open(f"{certs}/directory-a.json", "w") as f:
            json.dump({"nodes": [{"name": k, "ingress": f"127.0.0.1:{v}"} for k, v in ports.items()],
                      "sandboxes": {"rem": "b"}}, f)
        before = open(a.tmp + "/proxy.log").read().count("config reloaded")
        a.proxy.send_signal(signal.SIGHUP)
        wait_for("proxy A's reload", lambda: open(a.tmp + "/proxy.log").read().count("config reloaded") > before, 10)
        ctx = ssl.create_default_context(cafile=a.ca)
        hosts = {"local": f"8080-loc.{DOMAIN}", "remote": f"8080-rem.{DOMAIN}"}
        for host in hosts.values():  # serving (the servers need a moment), and warm
            wait_for(host, lambda: _try(a.port, ctx, host), 30)
            for _ in range(20):
                one_request(a.port, ctx, host)
        ms = {k: [] for k in hosts}
        tls_ms = {k: [] for k in hosts}
        cpu = {k: {"a": 0.0, "b": 0.0} for k in hosts}
        for _ in range(n):
            for path, host in hosts.items():
                ca, cb = cpu_s(a.proxy.pid), cpu_s(b.proxy.pid)
                total, tls = one_request(a.port, ctx, host)
                ms[path].append(total)
                tls_ms[path].append(tls)
                cpu[path]["a"] += cpu_s(a.proxy.pid) - ca
                cpu[path]["b"] += cpu_s(b.proxy.pid) - cb
        print(f"| path ({n} connections each, alternating) | connect to last byte, median ms | p90 ms | "
              "of which TLS handshake, median ms | proxy A CPU ms/conn | proxy B CPU ms/conn |")
        print("|---|--:|--:|--:|--:|--:|")
        for path in hosts:
            v = sorted(ms[path])
            print(f"| {path} | {statistics.median(v):.2f} | {v[int(len(v) * 0.9)]:.2f} | "
                  f"{statistics.median(tls_ms[path]):.2f} | "
                  f"{cpu[path]['a'] * 1000 / n:.2f} | {cpu[path]['b'] * 1000 / n:.2f} |")
        added = statistics.median(ms["remote"]) - statistics.median(ms["local"])
        print(f"\nadded by the hop (median): {added:.2f} ms")
    finally:
        for c in reversed(clusters):
            c.close()
        subprocess.run(["rm", "-rf", certs])


def _try(port, ctx, host):
    try:
        one_request(port, ctx, host)
        return True
    except (OSError, RuntimeError):
        return False


if __name__ == "__main__":
    main()
