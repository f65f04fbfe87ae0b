#!/usr/bin/env python3
"""Soak: N idle forwarded TLS connections held, then closed (issue 12; results in bench/RESULTS.md).

    bench/soak.py BUILD_DIR [N]        (default 10000; run as root)
    IMAGES_DIR=DIR  reuse a node images dir that has the `default` image (else it is built first)
    IMAGE=NAME      with IMAGES_DIR: another image of it with python3 (e.g. the tests' sandgate-test-*)
    HELD_WAIT=3     seconds between the last connection opened and the "held" reading

One sandgate-node + sandgate-proxy (one worker, userspace TLS). A sandbox on the default image runs a
keep-alive HTTP server (Python asyncio, any number of connections) on a public port. The client opens N TLS
connections from 50 loopback addresses, makes one request on each, and holds them all open (idle, forwarded:
the proxy holds the client side and the sandbox side of each). The proxy's RSS and open descriptors are read
before, while held, and after every connection was closed (at once, 5 s and 15 s later).
Prints a Markdown table; exits 1 if descriptors did not come back to the baseline.
"""
import asyncio
import os
import resource
import ssl
import sys
import time

from sgbench import DOMAIN, OK_SERVER, Cluster


def proc_stats(pid):
    rss_kib = 0
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return rss_kib, fds


async def hold(port, ctx, host, n, sources):
    conns = []
    sem = asyncio.Semaphore(200)  # handshakes in flight at once

    async def one(i):
        async with sem:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname=host,
                                                           local_addr=("127.0.4.%d" % (1 + i % sources), 0))
            writer.write(("GET / HTTP/1.1\r\nHost: %s\r\n\r\n" % host).encode())
            await writer.drain()
            data = await reader.readuntil(b"ok")
            if not data.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(data[:100])
            conns.append((reader, writer))

    results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    return conns, errors


async def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 10000
    # The client's N sockets; the daemons inherit the same limit. The proxy reserves 3 descriptors per
    # connection (6 where kTLS is possible: proxy/fd_limits.h), 64 for itself and up to 512 spare sockets per
    # worker (2 here), and refuses what RLIMIT_NOFILE cannot carry, so N must fit the hard limit.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    per_connection = 6 if os.path.exists("/proc/sys/net/ipv4/tcp_available_ulp") and \
        "tls" in open("/proc/sys/net/ipv4/tcp_available_ulp").read() else 3
    need = n * per_connection + 64 + 2 * min(hard // 16 // 2, 512)
    if need > hard:
        sys.exit(f"N={n} needs a hard RLIMIT_NOFILE of at least {need} (this one is {hard}): "
                 "raise it (ulimit -Hn, as root with CAP_SYS_RESOURCE) or lower N")
    limit = n + 1000
    c = Cluster(sys.argv[1], "soak", f"max_connections = {limit}\nmax_connections_per_client = {limit}\n"
                                     f"max_connections_per_sandbox = {limit}\n")
    try:
        image = os.environ.get("IMAGE", "default")
        if image == "default":
            c.ensure_default_image()
        c.create({"name": "soak", "image": image, "command": ["python3", "-c", OK_SERVER], "timeout_secs": 3600,
                  "ports": [{"port": 8080, "public": True}]})
        host = f"8080-soak.{DOMAIN}"
        ctx = ssl.create_default_context(cafile=c.ca)
        # Serving first (the server needs a moment), then a quiet baseline.
        for _ in range(200):
            try:
                conns, errors = await hold(c.port, ctx, host, 1, 1)
                if not errors:
                    break
            except OSError:
                pass
            await asyncio.sleep(0.05)
        for _, w in conns:
            w.close()
        await asyncio.sleep(2)
        base = proc_stats(c.proxy.pid)
        t0 = time.monotonic()
        conns, errors = await hold(c.port, ctx, host, n, 50)
        opened_s = time.monotonic() - t0
        # Quiet for a second, a connection gives its buffers back (Connection::kReleaseIdleMemoryAfterMs), and
        # the allocator returns freed pages within about a second more (dirty_decay_ms).
        await asyncio.sleep(float(os.environ.get('HELD_WAIT', '3')))
        held = proc_stats(c.proxy.pid)
        for _, w in conns:
            w.close()
        await asyncio.sleep(0.5)
        after = [proc_stats(c.proxy.pid)]
        await asyncio.sleep(4.5)
        after.append(proc_stats(c.proxy.pid))
        await asyncio.sleep(10)
        after.append(proc_stats(c.proxy.pid))
        held_n = len(conns)
        print(f"| N | opened (s) | errors | proxy RSS KiB: baseline / held / +0.5 s / +5 s / +15 s | "
              f"RSS per held connection | proxy fds: baseline / held / +0.5 s / +5 s / +15 s |")
        print("|--:|--:|--:|---|--:|---|")
        per = (held[0] - base[0]) / held_n if held_n else 0
        print(f"| {held_n} | {opened_s:.1f} | {len(errors)} | {base[0]} / {held[0]} / "
              f"{' / '.join(str(a[0]) for a in after)} | {per:.1f} KiB | {base[1]} / {held[1]} / "
              f"{' / '.join(str(a[1]) for a in after)} |")
        if errors:
            print("first errors:", [repr(e) for e in errors[:3]], file=sys.stderr)
        return 0 if after[-1][1] <= base[1] + 2 and not errors else 1
    finally:
        c.close()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
