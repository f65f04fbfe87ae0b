#!/usr/bin/env python3
"""Memory checkpoints, creates from them and forks of QEMU sandboxes (issue 11; results in bench/RESULTS.md).

    bench/memory_checkpoint.py BUILD_DIR [RUNS]     (default 3 runs per row; run as root)
    GUEST_DIR=DIR  the guest image (default BUILD_DIR/qemu-guest, built with deploy/build-guest-image.sh and
                   BUILD_DIR/agent/sandgate-agent when missing)

One sandgate-node + sandgate-proxy on loopback, QEMU under TCG on this machine (absolute times are not those of
KVM: the cold boot of the same run is the anchor). The guest runs busybox httpd on a public port 8080 and keeps
a counter in its RAM. Rows, medians of RUNS:
  - `checkpoint --type memory` of a guest of 128, 256 and 512 MiB: the node's pause_ms (the guest stopped), the
    POST until its 201, the saved device state's size and the RAM file's allocated bytes;
  - create to the first HTTP answer through the proxy: from a memory snapshot of the 256 MiB guest, and a cold
    create (a boot) of the same guest;
  - fork N = 1, 2, 4 of the 256 MiB guest: POST .../fork until its 201, per fork, and the forks' QEMUs' memory
    against N x 256 MiB: the sum of their Pss (shared pages divided among those mapping them, so the sum is
    what the forks cost together) and of their Private_Dirty (what each wrote, and QEMU's own heap).
"""
import http.client
import os
import socket
import ssl
import statistics
import subprocess
import sys
import time

from sgbench import DOMAIN, Cluster, print_ms_table

SERVER = ("mkdir -p /tmp/www/cgi-bin; printf '#!/bin/sh\\nn=$(cat /tmp/n 2>/dev/null || echo 0); n=$((n+1)); "
          "echo $n >/tmp/n; echo Content-Type: text/plain; echo; echo $n\\n' >/tmp/www/cgi-bin/c; "
          "chmod +x /tmp/www/cgi-bin/c; exec httpd -f -p 8080 -h /tmp/www")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    build = os.path.abspath(sys.argv[1])
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    c = Cluster.with_qemu(build, "memory-checkpoint-bench", 120000)
    tls = ssl.create_default_context(cafile=c.ca)

    def counter(name, timeout_s=120):
        """The guest's counter through the proxy, retried until it answers; (seconds waited, value)."""
        start = time.monotonic()
        host = f"8080-{name}.{DOMAIN}"
        while time.monotonic() - start < timeout_s:
            try:
                raw = socket.create_connection(("127.0.0.1", c.port), timeout=30)
                conn = http.client.HTTPSConnection(host, c.port, context=tls, timeout=30)
                conn.sock = tls.wrap_socket(raw, server_hostname=host)
                conn.request("GET", "/cgi-bin/c")
                r = conn.getresponse()
                body = r.read()
                conn.close()
                if r.status == 200:
                    return time.monotonic() - start, int(body.split()[0])
            except (OSError, http.client.HTTPException, ValueError):
                pass
            time.sleep(0.005)
        raise RuntimeError(f"{name}: no answer")

    def boot(name, memory_mb):
        t0 = time.monotonic()
        c.create({"name": name, "driver": "qemu", "memory_mb": memory_mb, "timeout_secs": 86400,
                  "command": ["/bin/sh", "-c", SERVER], "ports": [{"port": 8080, "public": True}]})
        counter(name)
        return (time.monotonic() - t0) * 1000

    def checkpoint(name):
        t0 = time.monotonic()
        status, answer = c.api("POST", f"/v1/sandboxes/{name}/checkpoint", {"type": "memory"})
        if status != 201:
            raise RuntimeError(f"checkpoint {name}: {status} {answer}")
        snapshot = answer["snapshot"]
        return (answer["pause_ms"], (time.monotonic() - t0) * 1000, snapshot["state_bytes"], snapshot.get("ram_bytes", 0),
                answer["snapshot_id"])

    def rollup_kib(sandbox_id, field):
        pid = subprocess.run(["pgrep", "-f", "sandgate-" + sandbox_id], capture_output=True, text=True).stdout.split()
        for line in open(f"/proc/{pid[0]}/smaps_rollup"):
            if line.startswith(field + ":"):
                return int(line.split()[1])
        return 0

    try:
        checkpoints = {}
        for mb in (128, 256, 512):
            boot(f"m{mb}", mb)
            counter(f"m{mb}")
            for _ in range(runs):
                pause, total, size, ram, snap = checkpoint(f"m{mb}")
                checkpoints.setdefault(mb, []).append((pause, total, size, ram))
                c.api("DELETE", f"/v1/snapshots/{snap}")
            if mb != 256:
                c.delete(f"m{mb}")
        print("| memory checkpoint | runs | paused ms (median) | POST to 201 ms (median) | device state bytes (median) | RAM file bytes (median) |")
        print("|---|--:|--:|--:|--:|--:|")
        for mb, values in checkpoints.items():
            print(f"| {mb} MiB guest | {len(values)} | {statistics.median(v[0] for v in values):.1f} | "
                  f"{statistics.median(v[1] for v in values):.1f} | {int(statistics.median(v[2] for v in values)):,} | "
                  f"{int(statistics.median(v[3] for v in values)):,} |")
        print()

        starts = {}
        snap = checkpoint("m256")[-1]
        for r in range(runs):
            t0 = time.monotonic()
            c.create({"name": f"from{r}", "snapshot_id": snap, "timeout_secs": 86400})
            counter(f"from{r}")
            starts.setdefault("create from the memory snapshot (256 MiB) to the first HTTP answer", []).append(
                (time.monotonic() - t0) * 1000)
            c.delete(f"from{r}")
            starts.setdefault("anchor: cold create (boot) of the same guest to the first HTTP answer", []).append(
                boot(f"cold{r}", 256))
            c.delete(f"cold{r}")
        print_ms_table("start", starts)
        print()

        print("| fork of the 256 MiB guest | runs | POST to 201 per fork ms (median) | forks' Pss sum MiB (median) | forks' Private_Dirty sum MiB (median) | N x 256 MiB |")
        print("|---|--:|--:|--:|--:|--:|")
        for n in (1, 2, 4):
            per_fork, pss, dirty = [], [], []
            for r in range(runs):
                t0 = time.monotonic()
                status, answer = c.api("POST", "/v1/sandboxes/m256/fork", {"count": n, "name_prefix": f"f{n}r{r}"})
                if status != 201:
                    raise RuntimeError(f"fork: {status} {answer}")
                per_fork.append((time.monotonic() - t0) * 1000 / n)
                for sb in answer["sandboxes"]:
                    counter(sb["name"])
                pss.append(sum(rollup_kib(sb["id"], "Pss") for sb in answer["sandboxes"]) / 1024)
                dirty.append(sum(rollup_kib(sb["id"], "Private_Dirty") for sb in answer["sandboxes"]) / 1024)
                for sb in answer["sandboxes"]:
                    c.delete(sb["name"])
                c.api("DELETE", f"/v1/snapshots/{answer['snapshot_id']}")
            print(f"| N = {n} | {runs} | {statistics.median(per_fork):.1f} | {statistics.median(pss):.0f} | "
                  f"{statistics.median(dirty):.0f} | {n * 256} |")
    finally:
        c.close()


if __name__ == "__main__":
    main()
