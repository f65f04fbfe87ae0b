"""sandgate._transport and _aio_transport against a scripted HTTP server on a unix socket: keep-alive reuse,
the retry on a connection the server closed while idle, streamed and chunked bodies."""
import asyncio
import os
import socket
import tempfile
import threading
import unittest

from sandgate import _aio_transport, _transport
from sandgate.errors import LimitError, UnavailableError


class FakeServer:
    """Answers each request with `answer(request_bytes)`; counts connections. close_after_each closes every
    connection after its answer without saying so (as a proxy does to a suspended sandbox's connections)."""

    def __init__(self, path, close_idle=False):
        self.path = path
        self.connections = 0
        self.requests = []
        self.close_idle = close_idle
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        buf = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = 0
                chunked = b"transfer-encoding: chunked" in head.lower()
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if chunked:
                    while not buf.endswith(b"0\r\n\r\n"):
                        buf += conn.recv(65536)
                    body, buf = buf, b""
                else:
                    while len(buf) < length:
                        buf += conn.recv(65536)
                    body, buf = buf[:length], buf[length:]
                self.requests.append((head, body))
                target = head.split(b" ")[1]
                if target == b"/stream":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                    for i in range(3):
                        line = b'{"n":%d}\n' % i
                        conn.sendall(b"%x\r\n%s\r\n" % (len(line), line))
                    conn.sendall(b"0\r\n\r\n")
                elif target == b"/big":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100)
                else:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                if self.close_idle:
                    return

    def close(self):
        self.sock.close()


class TransportTest(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory(prefix="sandgate-sdk-unit.")
        self.path = os.path.join(self._tmp.name, "s.sock")
        self.ep = _transport.Endpoint("unix", path=self.path, host_header="localhost")

    def tearDown(self):
        self._tmp.cleanup()

    def test_keep_alive_reuses_one_connection(self):
        server = FakeServer(self.path)
        pool = _transport.Pool()
        for i in range(5):
            r = pool.request(self.ep, "POST", "/echo", body=b"body%d" % i, timeout=5)
            self.assertEqual(r.read(1000), b"body%d" % i)
        lines = list(pool.request(self.ep, "GET", "/stream", timeout=5).lines(100))
        self.assertEqual(lines, [b'{"n":0}', b'{"n":1}', b'{"n":2}'])
        self.assertEqual(server.connections, 1)
        pool.discard("")  # unix endpoints have no TLS name: all of this test's idle connections
        pool.request(self.ep, "GET", "/echo", timeout=5).read(10)
        self.assertEqual(server.connections, 2)
        pool.close()
        server.close()

    def test_a_connection_closed_while_idle_is_not_an_error(self):
        server = FakeServer(self.path, close_idle=True)
        pool = _transport.Pool()
        for _ in range(3):
            self.assertEqual(pool.request(self.ep, "POST", "/echo", body=b"x", timeout=5).read(10), b"x")
        self.assertEqual(server.connections, 3)
        self.assertEqual(len(server.requests), 3)  # each sent exactly once
        # Closed between the idle check and the request: the failure comes before any answer byte, so the
        # request goes again on a fresh connection.
        stale = _transport.Connection.stale
        _transport.Connection.stale = lambda self: False
        try:
            for _ in range(2):
                self.assertEqual(pool.request(self.ep, "POST", "/echo", body=b"y", timeout=5).read(10), b"y")
        finally:
            _transport.Connection.stale = stale
        self.assertEqual(server.connections, 5)  # a fresh one for each, after the dead reused one failed
        self.assertEqual([b for _, b in server.requests[3:]], [b"y", b"y"])
        pool.close()
        server.close()

    def test_streamed_upload_and_limits(self):
        server = FakeServer(self.path)
        pool = _transport.Pool()
        import io
        r = pool.request(self.ep, "PUT", "/echo", body=io.BytesIO(b"a" * 300000), timeout=5)
        r.read(1 << 20)
        head, body = server.requests[-1]
        self.assertIn(b"Transfer-Encoding: chunked", head)
        self.assertTrue(body.endswith(b"0\r\n\r\n"))
        with self.assertRaises(LimitError):
            pool.request(self.ep, "GET", "/big", timeout=5).read(99)
        pool.close()
        server.close()
        with self.assertRaises(UnavailableError):
            _transport.Pool().request(_transport.Endpoint("unix", path=self.path + ".none", host_header="h"), "GET", "/")

    def test_async_pool(self):
        server = FakeServer(self.path)

        async def go():
            pool = _aio_transport.Pool()
            for i in range(3):
                r = await pool.request(self.ep, "POST", "/echo", body=b"b%d" % i, timeout=5)
                self.assertEqual(await r.read(100), b"b%d" % i)
            r = await pool.request(self.ep, "GET", "/stream", timeout=5)
            self.assertEqual([line async for line in r.lines(100)], [b'{"n":0}', b'{"n":1}', b'{"n":2}'])
            pool.close()

        asyncio.run(go())
        self.assertEqual(server.connections, 1)
        server.close()


if __name__ == "__main__":
    unittest.main()
