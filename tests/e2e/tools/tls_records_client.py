#!/usr/bin/env python3
"""One TLS 1.3 keep-alive connection through openssl s_client, on after the proxy's own record layer took it.

  tls_records_client.py ADDR PORT SNI CA_FILE METRICS_URL CIPHER_SUITE

Over one connection: GET /; then it waits (no fixed sleep: it reads the proxy's /metrics) until the proxy
says a connection moved to its own TLS record layer; then a KeyUpdate that asks for the proxy's (s_client's
"K" command), a 300,000-byte download, a 200,000-byte upload (the sandbox answers its sha256) and a GET /
again; then stdin's end makes s_client send close_notify. Prints "ok" when every answer was right, else what
went wrong. The backend is tests/e2e/tools/testserver.py (http mode).
"""
import hashlib
import os
import selectors
import subprocess
import sys
import time
import urllib.request

DEADLINE_S = 20


def blob(size):
    block = hashlib.sha256(b"sandgate").digest() * 2048
    out = bytearray()
    while len(out) < size:
        out += block
    return bytes(out[:size])


class SClient:
    def __init__(self, addr, port, sni, ca, suite):
        self.proc = subprocess.Popen(
            ["openssl", "s_client", "-connect", "%s:%s" % (addr, port), "-servername", sni, "-CAfile", ca,
             "-verify_return_error", "-tls1_3", "-ciphersuites", suite, "-alpn", "http/1.1"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.out = bytearray()
        self.err = bytearray()
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ, self.out)
        self.sel.register(self.proc.stderr, selectors.EVENT_READ, self.err)

    def pump_until(self, done, what):
        end = time.monotonic() + DEADLINE_S
        while not done():
            left = end - time.monotonic()
            if left <= 0:
                raise RuntimeError("timed out waiting for %s; stderr: %r" % (what, bytes(self.err[-500:])))
            for key, _ in self.sel.select(left):
                data = os.read(key.fileobj.fileno(), 65536)
                if not data:
                    raise RuntimeError("s_client ended waiting for %s; stderr: %r" % (what, bytes(self.err[-500:])))
                key.data.extend(data)

    def send(self, data):
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    # The next HTTP response on stdout after `start` (s_client prints its session details there too).
    def response(self, start):
        found = {}

        def complete():
            at = self.out.find(b"HTTP/1.1 ", start)
            if at < 0:
                return False
            end = self.out.find(b"\r\n\r\n", at)
            if end < 0:
                return False
            head = bytes(self.out[at:end]).decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.out) < end + 4 + length:
                return False
            found.update(status=head.split(" ")[1], body=bytes(self.out[end + 4:end + 4 + length]),
                         end=end + 4 + length)
            return True

        self.pump_until(complete, "a response")
        return found["status"], found["body"], found["end"]


def own_record_layers(url):
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith("sandgate_proxy_tls_own_record_layer_total "):
            return float(line.split()[1])
    return -1


def main():
    addr, port, sni, ca, metrics, suite = sys.argv[1:7]
    get = ("GET / HTTP/1.1\r\nHost: %s\r\n\r\n" % sni).encode()
    c = SClient(addr, port, sni, ca, suite)
    c.send(get)
    status, body, at = c.response(0)
    if status != "200" or not body.startswith(b"hello from"):
        return "first GET: %s %r" % (status, body[:80])

    end = time.monotonic() + DEADLINE_S
    while own_record_layers(metrics) < 1:
        if time.monotonic() > end:
            return "the connection never moved to the own record layer"
        time.sleep(0.1)  # polling the metric, with a deadline

    c.send(b"K\n")  # s_client: KeyUpdate, update_requested
    c.pump_until(lambda: b"KEYUPDATE" in c.err, "s_client's KeyUpdate")

    c.send(("GET /blob?size=300000 HTTP/1.1\r\nHost: %s\r\n\r\n" % sni).encode())
    status, body, at = c.response(at)
    if status != "200" or body != blob(300000):
        return "download after the switch: %s, %d bytes" % (status, len(body))

    upload = blob(200000)
    c.send(("POST /hash HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n\r\n" % (sni, len(upload))).encode() + upload)
    status, body, at = c.response(at)
    if status != "200" or body.decode().strip() != hashlib.sha256(upload).hexdigest():
        return "upload after the switch: %s %r" % (status, body[:80])

    c.send(get)
    status, body, at = c.response(at)
    if status != "200" or not body.startswith(b"hello from"):
        return "last GET: %s %r" % (status, body[:80])
    c.proc.stdin.close()
    c.proc.wait(timeout=DEADLINE_S)
    return "ok"


if __name__ == "__main__":
    try:
        print(main())
    except Exception as e:  # the test prints what went wrong
        print("error: %s" % e)
