"""The asyncio twin of _transport: the same framing (_http) and endpoints over asyncio streams, with
keep-alive connections reused per endpoint. A pool belongs to the event loop its connections were made in."""
import asyncio
import ssl

from . import _http
from ._transport import CONNECT_TIMEOUT_S, MAX_IDLE_PER_ENDPOINT, READ_SIZE, UPLOAD_CHUNK, _tls_error, ssl_context
from .config import dial_host
from .errors import LimitError, ProtocolError, TimeoutError, UnavailableError


class Connection:
    def __init__(self, endpoint, reader, writer):
        self.endpoint = endpoint
        self.reader = reader
        self.writer = writer
        self.reused = False

    @classmethod
    async def open(cls, endpoint):
        try:
            if endpoint.kind == "unix":
                coro = asyncio.open_unix_connection(endpoint.path, limit=READ_SIZE)
            elif endpoint.kind == "tcp":
                coro = asyncio.open_connection(dial_host(endpoint.host), endpoint.port, limit=READ_SIZE)
            else:
                coro = asyncio.open_connection(dial_host(endpoint.host), endpoint.port, limit=READ_SIZE,
                                               ssl=ssl_context(endpoint.cafile),
                                               server_hostname=endpoint.server_name)
            reader, writer = await asyncio.wait_for(coro, CONNECT_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{endpoint.describe()}: no connection within {CONNECT_TIMEOUT_S:.0f} s") from None
        except ssl.SSLError as e:
            raise _tls_error(endpoint, e) from None
        except OSError as e:
            raise UnavailableError(f"cannot connect to {endpoint.describe()}: {e.strerror or e}") from None
        return cls(endpoint, reader, writer)

    def stale(self):
        return self.writer.is_closing() or self.reader.at_eof() or bool(self.reader._buffer)  # noqa: SLF001

    def close(self):
        try:
            self.writer.close()
        except (OSError, RuntimeError):
            pass


async def _read(conn, timeout):
    try:
        return await asyncio.wait_for(conn.reader.read(READ_SIZE), timeout)
    except asyncio.TimeoutError:
        conn.close()
        raise TimeoutError(f"{conn.endpoint.describe()}: no data for {timeout:.0f} s") from None
    except OSError as e:
        conn.close()
        raise UnavailableError(f"{conn.endpoint.describe()}: connection broken: {e}") from None


class Response:
    """As _transport.Response, with `async for chunk in r.chunks()`, `await r.read(max)`, `r.lines(max)`."""

    def __init__(self, pool, conn, parser, pending, timeout):
        self._pool = pool
        self._conn = conn
        self._parser = parser
        self.head = parser.head
        self.status = parser.head.status
        self._pending = pending
        self._ended = parser.done
        self._timeout = timeout
        self._where = conn.endpoint.describe()
        if self._ended:
            self._release()

    def header(self, name, default=None):
        return self.head.header(name, default)

    async def chunks(self):
        while self._pending:
            yield self._pending.pop(0)
        while not self._ended:
            data = await _read(self._conn, self._timeout)
            try:
                events = self._parser.feed(data) if data else self._parser.eof()
            except ProtocolError:
                self.close()
                raise
            for kind, value in events:
                if kind == "data":
                    yield value
                elif kind == "end":
                    self._ended = True
            if self._ended:
                self._release()

    async def read(self, max_bytes):
        out = bytearray()
        async for chunk in self.chunks():
            out += chunk
            if len(out) > max_bytes:
                self.close()
                raise LimitError(f"{self._where}: answer larger than {max_bytes} bytes")
        return bytes(out)

    async def lines(self, max_line):
        splitter = _http.LineSplitter(max_line)
        async for chunk in self.chunks():
            for line in splitter.feed(chunk):
                yield line
        for line in splitter.rest():
            yield line

    def _release(self):
        if self._conn is not None:
            self._pool.put(self._conn, self._parser.keep_alive)
            self._conn = None

    def close(self):
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._ended = True


class Pool:
    def __init__(self):
        self._idle = {}

    async def get(self, endpoint):
        idle = self._idle.get(endpoint, [])
        while idle:
            conn = idle.pop()
            if not conn.stale():
                conn.reused = True
                return conn
            conn.close()
        return await Connection.open(endpoint)

    def put(self, conn, keep_alive):
        idle = self._idle.setdefault(conn.endpoint, [])
        if not keep_alive or len(idle) >= MAX_IDLE_PER_ENDPOINT * 4:
            conn.close()
        else:
            conn.reused = False
            idle.append(conn)

    def discard(self, server_name):
        """As _transport.Pool.discard."""
        for endpoint in [e for e in self._idle if e.server_name == server_name]:
            for conn in self._idle.pop(endpoint):
                conn.close()

    def close(self):
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()

    async def request(self, endpoint, method, target, headers=(), body=None, timeout=None):
        """As _transport.Pool.request (one retry on a fresh connection when a reused one fails before any
        answer byte). `body`: None, bytes, or an async iterable / iterable of bytes (sent chunked)."""
        for attempt in (0, 1):
            conn = await self.get(endpoint)
            try:
                return await self._exchange(conn, method, target, headers, body, timeout)
            except _Retry as e:
                conn.close()
                replayable = body is None or isinstance(body, (bytes, bytearray, memoryview))
                if attempt == 0 and conn.reused and replayable:
                    continue
                raise e.error from None

    async def _exchange(self, conn, method, target, headers, body, timeout):
        where = conn.endpoint.describe()
        streamed = body is not None and not isinstance(body, (bytes, bytearray, memoryview))
        if streamed:
            head = _http.build_head(method, target, conn.endpoint.host_header, headers, chunked=True)
        else:
            length = len(body) if body is not None else (0 if method in ("POST", "PUT") else None)
            head = _http.build_head(method, target, conn.endpoint.host_header, headers, content_length=length)
        try:
            conn.writer.write(head)
            if streamed:
                if hasattr(body, "__aiter__"):
                    async for data in body:
                        if data:
                            conn.writer.write(_http.encode_chunk(data))
                            await conn.writer.drain()
                else:
                    for data in body:
                        if data:
                            conn.writer.write(_http.encode_chunk(data))
                            await conn.writer.drain()
                conn.writer.write(_http.encode_chunk(b""))
            elif body:
                view = memoryview(body)
                for off in range(0, len(view), UPLOAD_CHUNK):
                    conn.writer.write(view[off:off + UPLOAD_CHUNK])
                    await conn.writer.drain()
            await asyncio.wait_for(conn.writer.drain(), timeout)
        except asyncio.TimeoutError:
            conn.close()
            raise TimeoutError(f"{where}: sending the request timed out") from None
        except OSError as e:
            if conn.reused:
                raise _Retry(UnavailableError(f"{where}: connection broken: {e}"))
        parser = _http.ResponseParser(no_body=(method == "HEAD"))
        pending = []
        got_any = False
        while parser.head is None:
            try:
                data = await asyncio.wait_for(conn.reader.read(READ_SIZE), timeout)
            except asyncio.TimeoutError:
                conn.close()
                raise TimeoutError(f"{where}: no answer within {timeout:.0f} s") from None
            except OSError as e:
                if not got_any:
                    raise _Retry(UnavailableError(f"{where}: connection broken: {e}"))
                conn.close()
                raise UnavailableError(f"{where}: connection broken: {e}") from None
            if not data and not got_any:
                raise _Retry(UnavailableError(f"{where}: the server closed the connection without answering"))
            got_any = True
            try:
                events = parser.feed(data) if data else parser.eof()
            except ProtocolError as e:
                conn.close()
                raise ProtocolError(f"{where}: {e}") from None
            for kind, value in events:
                if kind == "data":
                    pending.append(value)
        return Response(self, conn, parser, pending, timeout)


class _Retry(Exception):
    def __init__(self, error):
        super().__init__(str(error))
        self.error = error
