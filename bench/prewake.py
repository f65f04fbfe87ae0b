#!/usr/bin/env python3
"""Waking at the ClientHello, on and off (issue 12; results in bench/RESULTS.md).

    bench/prewake.py BUILD_DIR [RUNS] [RTT_MS]     (default 7 runs per row, 60 ms; run as root)
    GUEST_DIR=DIR  the guest image (default BUILD_DIR/qemu-guest, built with deploy/build-guest-image.sh and
                   BUILD_DIR/agent/sandgate-agent when missing)

One sandgate-node and two sandgate-proxies on loopback, one with proxy.wake_at_client_hello = true and one
with false, in front of the same QEMU sandbox (TCG here: its wakes take longer than under KVM). A client that
already used the sandbox's token (so the node's gate lets its ClientHello wake it) reaches each proxy through a
relay that delays every chunk by RTT/2 each way, as a client across a network would be: after its ClientHello
the proxy waits about one RTT for the request head, which is the time an early wake can save.

Rows, medians of RUNS (on and off alternate between runs, so both see the same machine), each with the
wake's own duration (the node's sandgate_node_wake_duration_seconds, read around each request) and the first
byte minus it, which is what the early start changes (a restore under TCG varies by hundreds of ms):
  - anchor: a new TLS connection and a request to the running sandbox, to the first byte of the answer;
  - the same while the sandbox is suspended in memory (QMP stop; the wake is a `cont`);
  - the same for a second guest hibernated to disk (hibernate_after_secs = 1; the wake is a restore: a new
    QEMU loading the saved state).
"""
import asyncio
import os
import socket
import ssl
import statistics
import subprocess
import sys
import threading
import time

from sgbench import DOMAIN, ROOT, Cluster, wait_for

SERVER = "mkdir -p /tmp/www && echo ok >/tmp/www/index.html && exec httpd -f -p 8080 -h /tmp/www"


class Relay:
    """127.0.0.1:<port> -> 127.0.0.1:<upstream>, each chunk delivered `delay_s` after it was read, in order."""

    def __init__(self, upstream, delay_s):
        self.upstream, self.delay_s = upstream, delay_s
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait()

    def _run(self, ready):
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    async def _pump(self, reader, writer):
        queue = asyncio.Queue()

        async def deliver():
            while True:
                due, data = await queue.get()
                wait = due - self.loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    writer.close()
                    return
                writer.write(data)
                await writer.drain()

        task = asyncio.create_task(deliver())
        while True:
            data = await reader.read(65536)
            queue.put_nowait((self.loop.time() + self.delay_s, data))
            if not data:
                break
        await task

    async def _handle(self, client_reader, client_writer):
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        await asyncio.gather(self._pump(client_reader, up_writer), self._pump(up_reader, client_writer),
                             return_exceptions=True)


def first_byte_ms(port, host, token, tls):
    """A new TLS connection through the relay and one request: ms to the first byte of the answer."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as raw:
        with tls.wrap_socket(raw, server_hostname=host) as s:
            s.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n"
                      "Connection: close\r\n\r\n".encode())
            first = s.recv(1)
            ms = (time.monotonic() - t0) * 1000
            rest = first
            while chunk := s.recv(65536):
                rest += chunk
    if not rest.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(rest[:200])
    return ms


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    build = os.path.abspath(sys.argv[1])
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    rtt_ms = float(sys.argv[3]) if len(sys.argv) > 3 else 60.0
    guest = os.environ.get("GUEST_DIR", build + "/qemu-guest")
    subprocess.run(["bash", ROOT + "/deploy/build-guest-image.sh", guest, build + "/agent/sandgate-agent"],
                   check=True, stdout=subprocess.DEVNULL)
    c = Cluster(build, "prewake-bench", proxy_toml="wake_at_client_hello = true\n",
                node_toml=f'guest_kernel = "{guest}/vmlinuz"\nguest_initrd = "{guest}/initrd.img"\n'
                          'qemu_boot_timeout_ms = 120000\nmax_timeout_secs = 86400\n')
    off_proxy = None
    try:
        # The second proxy: the same config but for the switch (and its own port).
        with open(c.tmp + "/sandgate.toml") as f:
            text = f.read()
        with open(c.tmp + "/off.toml", "w") as f:
            f.write(text.replace("wake_at_client_hello = true", "wake_at_client_hello = false"))
        off_log = c.tmp + "/proxy-off.log"
        off_proxy = subprocess.Popen([build + "/proxy/sandgate-proxy", "--config", c.tmp + "/off.toml"],
                                     stdout=open(off_log, "w"), stderr=subprocess.STDOUT)
        wait_for("the second proxy", lambda: "ready on" in open(off_log).read(), 30, off_proxy, off_log)
        line = [l for l in open(off_log) if "ready on 127.0.0.1:" in l][0]
        off_port = int(line.split("ready on 127.0.0.1:")[1].split()[0].rstrip(",;"))
        relays = {"on": Relay(c.port, rtt_ms / 2000), "off": Relay(off_port, rtt_ms / 2000)}

        # Two guests: one stays suspended in memory, the other is hibernated 1 s after each suspend.
        tls = ssl.create_default_context(cafile=c.ca)
        guests = {}
        for name, hibernate_after in (("mem", 86400), ("disk", 1)):
            _, sb = c.create({"name": name, "driver": "qemu", "memory_mb": 256, "timeout_secs": 86400,
                              "hibernate_after_secs": hibernate_after, "command": ["/bin/sh", "-c", SERVER],
                              "exposed_ports": [8080]})
            guests[name] = (f"8080-{name}.{DOMAIN}", sb["token"])
            # Serving, and the token verified from this address through both proxies (the node's gate).
            for mode in ("on", "off"):
                wait_for(f"{name}'s httpd", lambda: _answers(relays[mode].port, *guests[name], tls), 180)

        def asleep(name, tier):
            status, answer = c.api("POST", f"/v1/sandboxes/{name}/suspend")
            if status not in (200, 202):
                raise RuntimeError(f"suspend {name}: {status} {answer}")
            wait_for(f"{name} suspended ({tier})", lambda: _tier(c, name) == tier, 300)

        rows = (("anchor: the sandbox running", "mem", None), ("suspended in memory", "mem", "memory"),
                ("hibernated to disk", "disk", "disk"))
        def wake_seconds():
            """The node's total time spent in wakes so far (its histogram's sum)."""
            for line in _node_metrics(c)[1].splitlines():
                if line.startswith("sandgate_node_wake_duration_seconds_sum"):
                    return float(line.split()[1])
            return 0.0

        results, wakes = {}, {}
        for r in range(runs):
            for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                for what, name, tier in rows:
                    if tier:
                        asleep(name, tier)
                    before = wake_seconds()
                    results.setdefault((what, mode), []).append(first_byte_ms(relays[mode].port, *guests[name], tls))
                    wakes.setdefault((what, mode), []).append((wake_seconds() - before) * 1000)
        print(f"RTT {rtt_ms:.0f} ms through the relay, {runs} runs, ms to the first byte of the answer (medians; "
              "min-max)\n")
        # The wake itself (resume or restore, the node's own measure) varies by hundreds of ms under TCG; what
        # the early start changes is the time around it, so that is shown too: first byte minus the wake.
        print("| the sandbox | first byte, on | first byte, off | the wake, on | the wake, off | "
              "first byte minus the wake, on | off | saved |")
        print("|---|--:|--:|--:|--:|--:|--:|--:|")
        for what, _, _ in rows:
            on, off = results[(what, "on")], results[(what, "off")]
            won, woff = wakes[(what, "on")], wakes[(what, "off")]
            rest_on = statistics.median(a - b for a, b in zip(on, won))
            rest_off = statistics.median(a - b for a, b in zip(off, woff))
            print(f"| {what} | {statistics.median(on):.1f} ({min(on):.0f}-{max(on):.0f}) | "
                  f"{statistics.median(off):.1f} ({min(off):.0f}-{max(off):.0f}) | {statistics.median(won):.1f} | "
                  f"{statistics.median(woff):.1f} | {rest_on:.1f} | {rest_off:.1f} | {rest_off - rest_on:.1f} |")
        _, metrics = _node_metrics(c)
        for line in metrics.splitlines():
            if line.startswith("sandgate_node_prewakes_total") or line.startswith("sandgate_node_wakes_total"):
                print("    " + line)
    finally:
        if off_proxy is not None and off_proxy.poll() is None:
            off_proxy.terminate()
            off_proxy.wait(20)
        c.close()


def _answers(port, host, token, tls):
    try:
        first_byte_ms(port, host, token, tls)
        return True
    except (OSError, RuntimeError):
        return False


def _tier(c, name):
    status, sb = c.api("GET", f"/v1/sandboxes/{name}")
    return sb.get("tier") if status == 200 and sb.get("state") == "suspended" else None


def _node_metrics(c):
    conn = __import__("sgbench").UnixHTTPConnection(c.sock)
    conn.request("GET", "/metrics")
    r = conn.getresponse()
    return r.status, r.read().decode()


if __name__ == "__main__":
    main()
