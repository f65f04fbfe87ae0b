#!/usr/bin/env python3
"""Backend for sandgate's end-to-end tests; runs inside a sandbox.

  testserver.py http PORT MARKER   threaded HTTP/1.1 server:
      GET /            -> "hello from MARKER"
      GET /blob?size=N -> N deterministic bytes (sha256 checkable by the test)
      PUT|POST /hash   -> sha256 hex of the request body
      GET /slow?secs=S&steps=N -> body sent in N pieces (default 10) over S seconds (keeps a connection busy)
      GET /reset       -> no answer: the connection is reset (SO_LINGER 0)
      GET /refuse      -> 404 on a connection kept open (what a server that does not speak an Upgrade's
                          protocol answers it, before the next pipelined request)
      GET /seen        -> every request head this server has received so far (this one included), as it
                          parsed them: what the sandbox's code was given, and what it never saw
  testserver.py tcp PORT           raw TCP: reads until EOF (the client's half-close), then answers
                                   "<sha256> <bytes>\\n" and closes.
  testserver.py banner PORT MARKER raw TCP where the server speaks first: "banner MARKER\\n" at once, then
                                   one line read back as "echo: LINE\\n" (within 10 s), then it closes.
"""
import hashlib
import http.server
import socket
import struct
import sys
import threading
import time
import urllib.parse


def blob(size):
    block = hashlib.sha256(b"sandgate").digest() * 2048  # 64 KiB pattern
    out = bytearray()
    while len(out) < size:
        out += block
    return bytes(out[:size])


SEEN = []
SEEN_LOCK = threading.Lock()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    marker = "?"

    def parse_request(self):
        ok = super().parse_request()
        if ok:
            with SEEN_LOCK:
                SEEN.append(self.raw_requestline.decode("latin-1") + str(self.headers))
        return ok

    def log_message(self, *args):
        pass

    def send_body(self, body, ctype="text/plain"):
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        url = urllib.parse.urlparse(self.path)
        q = urllib.parse.parse_qs(url.query)
        if url.path == "/":
            return self.send_body(("hello from %s\n" % Handler.marker).encode())
        if url.path == "/seen":
            with SEEN_LOCK:
                return self.send_body("".join(SEEN).encode("latin-1"))
        if url.path == "/blob":
            return self.send_body(blob(int(q.get("size", ["0"])[0])), "application/octet-stream")
        if url.path == "/slow":
            secs = float(q.get("secs", ["1"])[0])
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            steps = int(q.get("steps", ["10"])[0])
            for i in range(steps):
                piece = ("tick %d\n" % i).encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
                time.sleep(secs / steps)
            self.wfile.write(b"0\r\n\r\n")
            return
        if url.path == "/refuse":
            body = b"not here\n"
            self.send_response(404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if url.path == "/reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            return
        self.send_error(404)

    def read_body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            h = hashlib.sha256()
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return h
                h.update(self.rfile.read(size))
                self.rfile.readline()
        h = hashlib.sha256()
        left = int(self.headers.get("Content-Length", "0"))
        while left > 0:
            chunk = self.rfile.read(min(left, 65536))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
        return h

    def do_PUT(self):
        h = self.read_body()
        self.send_body((h.hexdigest() + "\n").encode())

    do_POST = do_PUT


def serve_tcp(port):
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(64)

    def handle(conn):
        h = hashlib.sha256()
        total = 0
        while True:
            data = conn.recv(65536)
            if not data:
                break
            h.update(data)
            total += len(data)
        conn.sendall(("%s %d\n" % (h.hexdigest(), total)).encode())
        conn.close()

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def serve_banner(port, marker):
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(64)

    def handle(conn):
        conn.sendall(("banner %s\n" % marker).encode())
        conn.settimeout(10)
        line = b""
        try:
            while not line.endswith(b"\n"):
                data = conn.recv(1)
                if not data:
                    break
                line += data
            conn.sendall(b"echo: " + line)
        except OSError:
            pass
        conn.close()

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def main():
    mode, port = sys.argv[1], int(sys.argv[2])
    if mode == "tcp":
        return serve_tcp(port)
    if mode == "banner":
        return serve_banner(port, sys.argv[3] if len(sys.argv) > 3 else "?")
    Handler.marker = sys.argv[3] if len(sys.argv) > 3 else "?"
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
