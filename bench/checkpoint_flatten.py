#!/usr/bin/env python3
"""Flattening a long checkpoint chain (issue 11; docs/snapshots.md#flattening; results in bench/RESULTS.md).

    bench/checkpoint_flatten.py BUILD_DIR [RUNS] [LIMIT]   (default 3 runs, node.checkpoint_flatten_layers 32;
                                                            run as root)
    IMAGES_DIR=DIR  reuse a node images dir that has the `default` image (else it is built first)

One sandgate-node + sandgate-proxy on loopback, one process sandbox holding 64 MiB. Each step writes 1 MiB
through the sandbox's agent (`PUT /files`) and takes a filesystem checkpoint (`POST .../checkpoint`), until
RUNS checkpoints have flattened the chain. Rows, medians: the pause (`pause_ms`, the sandbox frozen) and the
total (the POST until its 201) of the checkpoints that flattened LIMIT layers first and of the ones that did
not, with the layers of the chain after each; then create to the agent's first answer from the last snapshot
against a cold create (the anchor, same run).
"""
import statistics
import sys
import time

from sgbench import Cluster, print_ms_table


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    limit = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    c = Cluster(sys.argv[1], "checkpoint-flatten-bench", node_toml=f"checkpoint_flatten_layers = {limit}\n")
    def checkpoint(name):
        t0 = time.monotonic()
        status, answer = c.api("POST", f"/v1/sandboxes/{name}/checkpoint", {"type": "filesystem"})
        total = (time.monotonic() - t0) * 1000
        if status != 201:
            raise RuntimeError(f"checkpoint {name}: {status} {answer}")
        return answer, total

    try:
        c.ensure_default_image()
        _, sb = c.create({"name": "long", "command": ["sleep", "infinity"], "timeout_secs": 3600})
        token = sb["token"]
        c.agent_answers("long", token)
        for i in range(64):
            if c.agent("long", token, "PUT", f"/files?path=/held{i}", mib=1) not in (201, 204):
                raise RuntimeError("PUT failed")
        rows = {"flattening": [], "not flattening": []}
        flattenings = 0
        step = 0
        snap = None
        while flattenings < runs:
            step += 1
            if c.agent("long", token, "PUT", f"/files?path=/step{step}", mib=1) not in (201, 204):
                raise RuntimeError("PUT failed")
            answer, total = checkpoint("long")
            snap = answer["snapshot_id"]
            flattened = answer.get("flattened_layers", 0)
            row = "flattening" if flattened else "not flattening"
            rows[row].append((answer["pause_ms"], total, len(answer["snapshot"]["layers"]), flattened))
            flattenings += 1 if flattened else 0
            if step > runs * (limit + 2):
                raise RuntimeError(f"no flattening after {step} checkpoints")

        print(f"{step} checkpoints, node.checkpoint_flatten_layers = {limit}, 1 MiB written before each, "
              f"64 MiB held")
        print()
        print("| checkpoint | count | pause ms (median) | total ms (median) | layers after (max) | flattened |")
        print("|---|--:|--:|--:|--:|--:|")
        for row, values in rows.items():
            print(f"| {row} | {len(values)} | {statistics.median(v[0] for v in values):.1f} | "
                  f"{statistics.median(v[1] for v in values):.0f} | {max(v[2] for v in values)} | "
                  f"{max(v[3] for v in values)} |")
        print()
        starts = {}
        for r in range(runs):
            t0 = time.monotonic()
            _, made = c.create({"name": f"from{r}", "snapshot_id": snap, "timeout_secs": 3600})
            c.agent_answers(f"from{r}", made["token"])
            starts.setdefault("create --from the last snapshot to the agent's first answer", []).append(
                (time.monotonic() - t0) * 1000)
            c.delete(f"from{r}")
            t0 = time.monotonic()
            _, made = c.create({"name": f"cold{r}", "command": ["sleep", "infinity"], "timeout_secs": 3600})
            c.agent_answers(f"cold{r}", made["token"])
            starts.setdefault("anchor: cold create on the default image to the agent's first answer", []).append(
                (time.monotonic() - t0) * 1000)
            c.delete(f"cold{r}")
        print_ms_table("start", starts)
    finally:
        c.close()


if __name__ == "__main__":
    main()
