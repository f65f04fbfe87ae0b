#!/usr/bin/python3
"""WebSocket echo server and client (Debian's python3-websockets) for sandgate's end-to-end tests.

  ws_echo.py serve PORT                             echo server on 0.0.0.0:PORT (runs inside a sandbox)
  ws_echo.py client URI CONNECT_PORT CA [TOKEN]     connects through the ingress at 127.0.0.1:CONNECT_PORT
                                                    (TLS verified with CA, SNI from URI), sends three
                                                    messages incl. a 1 MiB binary one, prints "ok N" when
                                                    every echo matched
"""
import asyncio
import hashlib
import ssl
import sys
import urllib.parse

import websockets


async def echo(ws, _path=None):
    async for message in ws:
        await ws.send(message)


async def serve(port):
    async with websockets.serve(echo, "0.0.0.0", port, max_size=8 << 20):
        print("ws_echo ready", flush=True)
        await asyncio.Future()


async def client(uri, connect_port, ca, token):
    ctx = ssl.create_default_context(cafile=ca)
    headers = {"Authorization": "Bearer " + token} if token else {}
    # Connect to the ingress on loopback but verify and send SNI for the URI's name.
    async with websockets.connect(uri, host="127.0.0.1", port=connect_port, ssl=ctx, extra_headers=headers,
                                  server_hostname=urllib.parse.urlsplit(uri).hostname, max_size=8 << 20) as ws:
        messages = ["hello", "second message", hashlib.sha256(b"x").digest() * 32768]
        for m in messages:
            await ws.send(m)
            if await ws.recv() != m:
                print("mismatch")
                return 1
        print("ok", len(messages))
        return 0


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        asyncio.run(serve(int(sys.argv[2])))
    else:
        sys.exit(asyncio.run(client(sys.argv[2], int(sys.argv[3]), sys.argv[4],
                                    sys.argv[5] if len(sys.argv) > 5 else "")))
