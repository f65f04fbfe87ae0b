#!/usr/bin/env python3
"""Slowloris against the TLS ingress, with legitimate load alongside (issue 12, "Slowloris").

    slowloris.py PORT CA HOST SLOW LEGIT [SOURCES]

Opens SLOW connections to 127.0.0.1:PORT from SOURCES source addresses (127.0.2.1 ... , so the per-client
connection limit does not refuse them before they can be slow): half trickle a TLS ClientHello one byte at a
time, half finish the handshake for HOST and trickle an HTTP request head one byte at a time, each byte
0.5 s apart. Meanwhile it makes LEGIT ordinary HTTPS requests (new connection each, from 127.0.0.1) to HOST,
one after another. Then it waits for every slow connection to be closed by the proxy.

Prints one JSON object: legit ok/failed counts and latencies, and for the slow ones how many the proxy closed,
when (seconds after they opened), and how many were still open at the end.
"""
import asyncio
import json
import ssl
import sys
import time

TRICKLE_S = 0.5


async def trickle(reader, writer, data, start, opened):
    """Sends `data` a byte every TRICKLE_S until the proxy closes: the seconds that took, None if it never did."""
    opened()
    for b in data:
        try:
            writer.write(bytes([b]))
            await writer.drain()
            got = await asyncio.wait_for(reader.read(4096), TRICKLE_S)
            if got == b"" or got.startswith(b"HTTP/1.1 408"):
                return time.monotonic() - start
        except asyncio.TimeoutError:
            continue
        except (OSError, ssl.SSLError):
            return time.monotonic() - start
    return None


async def slow_handshake(port, source, results, opened):
    start = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    except OSError as e:
        results.append({"kind": "handshake", "error": str(e)})
        return opened()
    # A TLS record header and the start of a ClientHello, never finished.
    hello = bytes([0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xFC, 0x03, 0x03]) + bytes(64)
    closed_at = await trickle(reader, writer, hello, start, opened)
    writer.close()
    results.append({"kind": "handshake", "closed_after": closed_at})


async def slow_head(port, ctx, host, source, results, opened):
    start = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname=host,
                                                       local_addr=(source, 0))
    except (OSError, ssl.SSLError) as e:
        results.append({"kind": "head", "error": str(e)})
        return opened()
    head = ("GET / HTTP/1.1\r\nHost: %s\r\n" % host + "X-Slow: " + "a" * 200).encode()
    closed_at = await trickle(reader, writer, head, start, opened)
    writer.close()
    results.append({"kind": "head", "closed_after": closed_at})


async def legit(port, ctx, host, count, out):
    for _ in range(count):
        start = time.monotonic()
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname=host), 5)
            writer.write(("GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % host).encode())
            await writer.drain()
            data = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            ok = data.startswith(b"HTTP/1.1 200")
        except (OSError, ssl.SSLError, asyncio.TimeoutError):
            ok = False
        out.append((ok, time.monotonic() - start))


async def main():
    port, ca, host = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    slow, legit_count = int(sys.argv[4]), int(sys.argv[5])
    sources = int(sys.argv[6]) if len(sys.argv) > 6 else 8
    ctx = ssl.create_default_context(cafile=ca)
    results, legit_results = [], []
    tasks = []
    # The legitimate load starts once every slow connection is open (or failed to open) and trickling.
    all_open = asyncio.Event()
    pending = [slow]

    def opened():
        pending[0] -= 1
        if pending[0] == 0:
            all_open.set()
    for i in range(slow):
        source = "127.0.2.%d" % (1 + i % sources)
        tasks.append(slow_handshake(port, source, results, opened) if i % 2 == 0
                     else slow_head(port, ctx, host, source, results, opened))
    slow_all = asyncio.gather(*tasks)
    await asyncio.wait_for(all_open.wait(), 60)
    await legit(port, ctx, host, legit_count, legit_results)
    await slow_all
    closed = [r["closed_after"] for r in results if r.get("closed_after") is not None]
    latencies = sorted(t for ok, t in legit_results if ok)
    print(json.dumps({
        "legit_ok": sum(1 for ok, _ in legit_results if ok),
        "legit_failed": sum(1 for ok, _ in legit_results if not ok),
        "legit_p50_ms": round(latencies[len(latencies) // 2] * 1000, 1) if latencies else None,
        "legit_max_ms": round(latencies[-1] * 1000, 1) if latencies else None,
        "slow_opened": sum(1 for r in results if "error" not in r),
        "slow_errors": [r["error"] for r in results if "error" in r][:5],
        "slow_closed": len(closed),
        "slow_still_open": sum(1 for r in results if "error" not in r and r.get("closed_after") is None),
        "slow_closed_after_max_s": round(max(closed), 2) if closed else None,
    }))


asyncio.run(main())
