#!/usr/bin/env python3
"""Filesystem checkpoints of QEMU sandboxes booted on an image's disk (issue 11; results in bench/RESULTS.md).

    bench/qemu_disk_checkpoint.py BUILD_DIR [RUNS]     (default 3 runs per row; run as root)
    GUEST_DIR=DIR   the guest kernel and initramfs (default BUILD_DIR/qemu-guest, built when missing)
    IMAGES_DIR=DIR  reuse a node images dir that has the `default` image (else it is built first)

One sandgate-node + sandgate-proxy on loopback, QEMU under TCG (absolute times are not KVM's: the cold boot of
the same run is the anchor). Files go into the guest through its agent (`PUT /files`, through the TLS proxy).
A checkpoint of a running guest is a QEMU backup job: the first copies the guest's whole overlay, each later
one the clusters written since the one before (a dirty bitmap) over that one's disk. Rows, medians of RUNS:
  - transaction (the moment the guest's disk requests drain: the node's pause_ms; the guest never stops),
    total (`POST .../checkpoint` until its 201: the guest's sync, the job, the hash and sync of the file) and
    the snapshot's disk bytes, for 0 and 1 MiB written since the previous checkpoint on a guest holding
    192 MiB, 1 MiB on one holding 16 MiB, 16 and 128 MiB on one holding 64 MiB (the image's disk leaves
    256 MiB free in the guest);
  - each guest's first checkpoint: its whole overlay (what every checkpoint cost before);
  - create to the agent's first answer: from the last snapshot (a chain of deltas) and a cold create of the
    same guest on the image (the anchor).
"""
import json
import os
import statistics
import sys
import time

from sgbench import Cluster, print_ms_table


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    build = os.path.abspath(sys.argv[1])
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    c = Cluster.with_qemu(build, "qemu-disk-checkpoint-bench", 180000)
    def write(name, token, mib, path):
        if not mib:
            return
        # Removed first: the agent writes a temp file and renames it over the old one, which would need the
        # old file's blocks and the new file's at once (the guest has 256 MiB free).
        rm = json.dumps({"command": ["rm", "-f", path]})
        if c.agent(name, token, "POST", "/exec", body=rm, content_type="application/json") != 200:
            raise RuntimeError(f"rm {path}")
        status = c.agent(name, token, "PUT", f"/files?path={path}", mib=mib)
        if status not in (201, 204):
            raise RuntimeError(f"PUT {path}: {status}")

    def checkpoint(name):
        t0 = time.monotonic()
        status, answer = c.api("POST", f"/v1/sandboxes/{name}/checkpoint", {"type": "filesystem"})
        total = (time.monotonic() - t0) * 1000
        if status != 201:
            raise RuntimeError(f"checkpoint {name}: {status} {answer}")
        return answer["pause_ms"], total, answer["snapshot"].get("disk_bytes") or 0, answer["snapshot_id"]

    def boot(name, snapshot=None):
        body = {"name": name, "timeout_secs": 86400, "memory_mb": 512}
        if snapshot:  # its driver, image and command are the snapshot's
            body["snapshot_id"] = snapshot
        else:
            body.update({"driver": "qemu", "image": "default", "command": ["sleep", "infinity"]})
        t0 = time.monotonic()
        _, sb = c.create(body)
        c.agent_answers(name, sb["token"], 300)
        return (time.monotonic() - t0) * 1000, sb["token"]

    rows = {}

    def add(row, values):
        rows.setdefault(row, []).append(values)

    try:
        c.ensure_default_image()
        # The image's disk leaves about 256 MiB free in the guest: the rows that write 16 and 128 MiB run on a
        # guest holding 64 MiB, and each run replaces the same file (its blocks are freed and taken again).
        sandboxes = {}
        for name, holds in (("small", 16), ("mid", 64), ("big", 192)):
            _, token = boot(name)
            for i in range(holds // 16):
                write(name, token, 16, f"/root/held{i}")
            pause, total, size, _ = checkpoint(name)
            add(f"first checkpoint, {holds} MiB held (the whole overlay)", (pause, total, size))
            sandboxes[name] = token
        for _ in range(runs):
            for name, holds, mib in (("big", 192, 0), ("big", 192, 1), ("small", 16, 1), ("mid", 64, 16),
                                     ("mid", 64, 128)):
                write(name, sandboxes[name], mib, f"/root/changed{mib}")
                pause, total, size, snap = checkpoint(name)
                add(f"{holds} MiB held, {mib} MiB written since the last checkpoint", (pause, total, size))
        print("| QEMU disk checkpoint | runs | transaction ms (median) | POST to 201 ms (median) | disk bytes (median) |")
        print("|---|--:|--:|--:|--:|")
        for row, values in rows.items():
            print(f"| {row} | {len(values)} | {statistics.median(v[0] for v in values):.1f} | "
                  f"{statistics.median(v[1] for v in values):.0f} | {int(statistics.median(v[2] for v in values)):,} |")
        print()

        starts = {}
        for r in range(runs):
            ms, _ = boot(f"from{r}", snap)
            starts.setdefault(f"create from the 64 MiB guest's last snapshot (a chain of {1 + 2 * runs} disks) "
                              "to the agent's first answer", []).append(ms)
            c.delete(f"from{r}")
            ms, _ = boot(f"cold{r}")
            starts.setdefault("anchor: cold create (boot) on the image to the agent's first answer", []).append(ms)
            c.delete(f"cold{r}")
        print_ms_table("start", starts)
    finally:
        c.close()


if __name__ == "__main__":
    main()
