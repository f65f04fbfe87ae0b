#!/usr/bin/env python3
"""Filesystem checkpoints of a process sandbox (issue 11's bench; results in bench/RESULTS.md).

    bench/checkpoint.py BUILD_DIR [RUNS]     (default 3 runs per row; run as root)
    IMAGES_DIR=DIR  reuse a node images dir that has the `default` image (else it is built first)

One sandgate-node + sandgate-proxy on loopback. Files go into the sandbox through its agent
(`PUT /files`, through the TLS proxy with the sandbox's token). Rows, medians of RUNS:
  - pause (the node's `pause_ms`: the sandbox frozen) and total (`POST .../checkpoint` until its 201) and the
    layer size, for 0, 1, 16 and 128 MiB written since the previous checkpoint, on a sandbox holding 256 MiB;
  - the same for 1 MiB changed on sandboxes holding 64 MiB and 1 GiB: the cost must follow the bytes changed,
    not the size; and on sandboxes holding 64 MiB with `disk_mb` 1024 and 8192 (a sparse ext4 file each);
  - create to the agent's first answer: from a snapshot (256 MiB in its layers) and a cold create on the
    default image (the anchor, same run).
"""
import statistics
import sys
import time

from sgbench import Cluster, print_ms_table


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    c = Cluster(sys.argv[1], "checkpoint-bench")
    seq = [0]

    def write(name, token, mib):
        seq[0] += 1
        status = c.agent(name, token, "PUT", f"/files?path=/f{seq[0]}", mib=mib) if mib else 0
        if mib and status not in (201, 204):
            raise RuntimeError(f"PUT: {status}")

    def checkpoint(name):
        t0 = time.monotonic()
        status, answer = c.api("POST", f"/v1/sandboxes/{name}/checkpoint", {"type": "filesystem"})
        total = time.monotonic() - t0
        if status != 201:
            raise RuntimeError(f"checkpoint {name}: {status} {answer}")
        return answer["pause_ms"], total * 1000, answer["snapshot"].get("layer_bytes") or 0, answer["snapshot_id"]

    rows = {}

    def add(row, pause, total, size):
        rows.setdefault(row, []).append((pause, total, size))

    try:
        c.ensure_default_image()

        def sandbox(name, holds_mib, disk_mb=0):
            body = {"name": name, "command": ["sleep", "infinity"], "timeout_secs": 3600}
            if disk_mb:
                body["disk_mb"] = disk_mb
            _, sb = c.create(body)
            c.agent_answers(name, sb["token"])
            for _ in range(holds_mib // 64):
                write(name, sb["token"], 64)
            checkpoint(name)  # the baseline: what it holds is in a layer now
            return sb["token"]

        token = sandbox("big", 256)
        snap = None
        for r in range(runs):
            for mib in (0, 1, 16, 128):
                write("big", token, mib)
                pause, total, size, snap = checkpoint("big")
                add(f"256 MiB held, {mib} MiB written since the last checkpoint", pause, total, size)
        for holds in (64, 1024):
            name = f"h{holds}"
            t = sandbox(name, holds)
            for r in range(runs):
                write(name, t, 1)
                pause, total, size, _ = checkpoint(name)
                add(f"{holds} MiB held, 1 MiB written", pause, total, size)
            c.delete(name)
        # disk_mb: the upper dir on a sparse ext4 file of that size (the node reads it through the sandbox's
        # loop device): the cost must not follow the disk's size either.
        for disk_mb in (1024, 8192):
            name = f"d{disk_mb}"
            t = sandbox(name, 64, disk_mb)
            for r in range(runs):
                write(name, t, 1)
                pause, total, size, _ = checkpoint(name)
                add(f"disk_mb {disk_mb} (sparse), 64 MiB held, 1 MiB written", pause, total, size)
            c.delete(name)

        starts = {}
        for r in range(runs):
            t0 = time.monotonic()
            _, sb = c.create({"name": f"from{r}", "snapshot_id": snap, "timeout_secs": 3600})
            c.agent_answers(f"from{r}", sb["token"])
            starts.setdefault("create --from the snapshot (256 MiB+ in its layers) to the agent's first answer", []).append(
                (time.monotonic() - t0) * 1000)
            c.delete(f"from{r}")
            t0 = time.monotonic()
            _, sb = c.create({"name": f"cold{r}", "command": ["sleep", "infinity"], "timeout_secs": 3600})
            c.agent_answers(f"cold{r}", sb["token"])
            starts.setdefault("anchor: cold create on the default image to the agent's first answer", []).append(
                (time.monotonic() - t0) * 1000)
            c.delete(f"cold{r}")

        print("| checkpoint | runs | pause ms (median) | total ms (median) | layer bytes (median) |")
        print("|---|--:|--:|--:|--:|")
        for row, values in rows.items():
            print(f"| {row} | {len(values)} | {statistics.median(v[0] for v in values):.1f} | "
                  f"{statistics.median(v[1] for v in values):.1f} | {int(statistics.median(v[2] for v in values)):,} |")
        print()
        print_ms_table("start", starts)
    finally:
        c.close()


if __name__ == "__main__":
    main()
