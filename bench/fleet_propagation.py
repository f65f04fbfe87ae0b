#!/usr/bin/env python3
"""Watch propagation in a fleet (issue 13; results in bench/RESULTS.md): from a create's answer until every
proxy routes the new sandbox, on a 3-machine fleet made by deploy/fleet-machine.sh on 127.0.0.1-3 (a 3-member
etcd, three nodes and three proxies, as the e2e test FleetMachine.* runs it).

    bench/fleet_propagation.py BUILD_DIR [N]     (default 30 creates; run as root)
    IMAGES_DIR=DIR IMAGE=NAME  a node images dir and an image in it that has /bin/sleep (required)

Each create goes to node 1's API and placement picks the node. From just before the create is sent, one
thread per proxy opens new TLS connections for 8080-<name>.<domain> (SNI and Host) until the answer is not the
proxy's 404 for an unknown sandbox (the sandbox runs no server, so a routed request ends in 502/503 from the
owner: what counts is that the proxy knew where it lives). A sample is when the first routed poll was sent,
relative to the create's answer (negative: the proxy knew before the client did), per proxy, split by whether
the proxy runs on the owning node or another (both learn from etcd's watch). A poll (one TLS handshake and a
404) takes a few ms here, which bounds the resolution.
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
import threading
import time

from sgbench import DOMAIN, ROOT, UnixHTTPConnection, stop, wait_for

MACHINES = 3


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_through(ip, port, ctx, host):
    with socket.create_connection((ip, port), timeout=10) as raw:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with ctx.wrap_socket(raw, server_hostname=host) as s:
            s.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            line = s.recv(64)
    return int(line.split()[1]) if line.startswith(b"HTTP/1.1 ") else 0


def api(sock, method, path, body=None):
    conn = UnixHTTPConnection(sock)
    conn.request(method, path, body=json.dumps(body) if body is not None else None,
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, json.loads(data) if data else {}


def main():
    if len(sys.argv) < 2 or not os.environ.get("IMAGES_DIR") or not os.environ.get("IMAGE"):
        sys.exit(__doc__)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    build = os.path.abspath(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    tmp = tempfile.mkdtemp(prefix="sandgate-fleet-propagation.")
    procs = []
    ports = {k: free_port() for k in ("etcd_client", "etcd_peer", "fleet", "api", "ingress")}
    members = ",".join(f"m{i}=127.0.0.{i}" for i in range(1, MACHINES + 1))
    try:
        subprocess.run([ROOT + "/deploy/gen-fleet-ca.sh", tmp + "/fleet-ca"] + [f"m{i}" for i in range(1, MACHINES + 1)],
                       check=True, stdout=subprocess.DEVNULL)
        subprocess.run([ROOT + "/deploy/gen-cert.sh", tmp + "/tls", DOMAIN], check=True, stdout=subprocess.DEVNULL)
        with open(tmp + "/operator.token", "w") as f:
            f.write("fleet-propagation-bench\n")
        os.chmod(tmp + "/operator.token", 0o600)
        for i in range(1, MACHINES + 1):
            root = f"{tmp}/m{i}"
            env = dict(os.environ, ROOT=root, FLEET_CA_DIR=tmp + "/fleet-ca", OPERATOR_TOKEN_FILE=tmp + "/operator.token",
                       TLS_CERT=tmp + "/tls/server.pem", TLS_KEY=tmp + "/tls/server.key",
                       INGRESS_LISTEN=f"127.0.0.{i}:{ports['ingress']}", ETCD_CLIENT_PORT=str(ports["etcd_client"]),
                       ETCD_PEER_PORT=str(ports["etcd_peer"]), FLEET_PORT=str(ports["fleet"]), API_PORT=str(ports["api"]),
                       CGROUP_NAME=f"sgbench-prop-{os.getpid()}-{i}", SANDGATE_PROXY=build + "/proxy/sandgate-proxy",
                       NODE_EXTRA=f'on_shutdown = "terminate"\ninit_path = "{build}/noderuntime/sandgate-init"\n'
                                  f'images_dir = "{os.environ["IMAGES_DIR"]}"\ndefault_image = "{os.environ["IMAGE"]}"\n')
            subprocess.run(["bash", ROOT + "/deploy/fleet-machine.sh", f"m{i}", f"127.0.0.{i}", members], env=env,
                           check=True, stderr=subprocess.DEVNULL)
            etcd_env = dict(os.environ)
            for line in open(root + "/etc/default/etcd"):
                if "=" in line and not line.startswith("#"):
                    k, v = line.strip().split("=", 1)
                    etcd_env[k] = v
            procs.append(subprocess.Popen(["/usr/bin/etcd"], env=etcd_env, stdout=open(root + "/etcd.log", "w"),
                                          stderr=subprocess.STDOUT))
        for i in range(1, MACHINES + 1):
            root = f"{tmp}/m{i}"
            os.makedirs(root + "/run/sandgate", exist_ok=True)
            conf = root + "/etc/sandgate/sandgate.toml"
            node_log = root + "/node.log"
            node = subprocess.Popen([build + "/noderuntime/sandgate-node", "--config", conf],
                                    stdout=open(node_log, "w"), stderr=subprocess.STDOUT)
            procs.append(node)
            wait_for(f"node m{i}", lambda: f"fleet: node m{i} registered" in open(node_log).read(), 30, node, node_log)
            proxy_log = root + "/proxy.log"
            proxy = subprocess.Popen([build + "/proxy/sandgate-proxy", "--config", conf],
                                     stdout=open(proxy_log, "w"), stderr=subprocess.STDOUT)
            procs.append(proxy)
            wait_for(f"proxy m{i}", lambda: "sandgate-proxy ready" in open(proxy_log).read(), 30, proxy, proxy_log)
        socks = {f"m{i}": f"{tmp}/m{i}/run/sandgate/node.sock" for i in range(1, MACHINES + 1)}
        wait_for("every node in every view", lambda: all(
            len(api(s, "GET", "/v1/fleet/nodes")[1].get("nodes", [])) == MACHINES for s in socks.values()), 30)
        ctx = ssl.create_default_context(cafile=tmp + "/tls/ca.pem")

        samples = {"owner's proxy": [], "other proxies": []}
        from_send = {"owner's proxy": [], "other proxies": []}
        create_ms = []
        placed = {}
        for k in range(n):
            name = f"p{k}"
            host = f"8080-{name}.{DOMAIN}"
            result = {}
            started = time.perf_counter()

            def poll(i):
                while True:
                    sent = time.perf_counter()
                    if status_through(f"127.0.0.{i}", ports["ingress"], ctx, host) != 404:
                        result[i] = (sent - started) * 1000
                        return
                    if sent - started > 30:
                        result[i] = float("inf")
                        return

            # The proxies are asked from before the create is sent: a sample is when the first poll that was
            # routed went out (the answer to it can take longer: the owner holds it until the sandbox runs).
            threads = [threading.Thread(target=poll, args=(i,)) for i in range(1, MACHINES + 1)]
            for t in threads:
                t.start()
            status, body = api(socks["m1"], "POST", "/v1/sandboxes",
                               {"name": name, "command": ["/bin/sleep", "3600"], "exposed_ports": [8080]})
            create_ms.append((time.perf_counter() - started) * 1000)
            if status != 201:
                sys.exit(f"create {name}: {status} {body}")
            owner = body.get("node", "")
            placed[owner] = placed.get(owner, 0) + 1
            for t in threads:
                t.join()
            for i, ms in result.items():
                kind = "owner's proxy" if owner == f"m{i}" else "other proxies"
                samples[kind].append(ms - create_ms[-1])
                from_send[kind].append(ms)
            api(socks[owner], "DELETE", f"/v1/sandboxes/{name}")

        print(f"{n} creates through m1's API, placed {placed}; the create's answer came after "
              f"{statistics.median(create_ms):.1f} ms (median; max {max(create_ms):.1f})")
        print("| proxy | samples | first routed poll sent, after the create was sent: median ms | max ms | "
              "relative to the create's answer: median ms | max ms | before the answer |")
        print("|---|--:|--:|--:|--:|--:|--:|")
        for kind, v in samples.items():
            v, sent = sorted(v), sorted(from_send[kind])
            if not v:
                continue
            print(f"| {kind} | {len(v)} | {statistics.median(sent):.1f} | {sent[-1]:.1f} | {statistics.median(v):+.1f} | "
                  f"{v[-1]:+.1f} | {sum(1 for x in v if x < 0)} |")
    finally:
        for p in reversed(procs):
            stop(p)
        subprocess.run(["rm", "-rf", tmp])


if __name__ == "__main__":
    main()
