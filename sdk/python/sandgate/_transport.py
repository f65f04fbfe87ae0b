"""Blocking HTTP/1.1 over a unix socket, TCP or TLS, with keep-alive connections reused per endpoint.

An Endpoint says where to dial and what the server must prove: for TLS the name that goes in SNI and is
checked against the certificate (the CA file's, or the system's trust store), which is not the address
dialled (the ingress serves every <name>.<domain> on one address)."""
import dataclasses
import select
import socket
import ssl
import threading

from . import _http
from .config import dial_host
from .errors import ProtocolError, TimeoutError, UnavailableError

CONNECT_TIMEOUT_S = 30.0
MAX_IDLE_PER_ENDPOINT = 8   # idle keep-alive connections kept per endpoint; more are closed
READ_SIZE = 64 * 1024
UPLOAD_CHUNK = 256 * 1024


@dataclasses.dataclass(frozen=True)
class Endpoint:
    kind: str                 # "unix", "tcp" or "tls"
    path: str = ""            # unix
    host: str = ""            # tcp / tls: the address dialled
    port: int = 0
    server_name: str = ""     # tls: SNI and the name the certificate must carry
    host_header: str = ""     # the request's Host
    cafile: str = ""          # tls: "" = the system's trust store
    # Which credential the connection's requests carry (a digest of it, not the token): the ingress checks
    # the token when a connection opens and routes its later requests on that, so a connection opened with
    # one sandbox token must never carry another's requests.
    credential: str = ""

    def describe(self):
        if self.kind == "unix":
            return "unix:" + self.path
        name = self.server_name or self.host
        return f"{name} (via {self.host}:{self.port})" if name != self.host else f"{self.host}:{self.port}"


_contexts = {}
_contexts_lock = threading.Lock()


def ssl_context(cafile):
    """One verifying client context per CA file: TLS 1.2+, hostname checked, ALPN http/1.1 (the SDK speaks
    HTTP/1.1; the ingress forwards it to the agent, which serves both)."""
    with _contexts_lock:
        ctx = _contexts.get(cafile)
        if ctx is None:
            try:
                ctx = ssl.create_default_context(cafile=cafile or None)
            except (OSError, ssl.SSLError) as e:
                raise UnavailableError(f"cannot load the CA file {cafile!r} (SANDGATE_CACERT / cacert=): {e}") from None
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.set_alpn_protocols(["http/1.1"])
            _contexts[cafile] = ctx
        return ctx


def _tls_error(endpoint, e):
    if isinstance(e, ssl.SSLCertVerificationError):
        return UnavailableError(
            f"{endpoint.describe()}: the certificate is not trusted ({e.verify_message}): pass the CA that signed "
            "it with cacert= or SANDGATE_CACERT")
    return UnavailableError(f"{endpoint.describe()}: TLS handshake failed: {e}")


class Connection:
    def __init__(self, endpoint, timeout):
        self.endpoint = endpoint
        self.reused = False
        sock = None
        try:
            if endpoint.kind == "unix":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(min(timeout or CONNECT_TIMEOUT_S, CONNECT_TIMEOUT_S))
                sock.connect(endpoint.path)
            else:
                sock = socket.create_connection((dial_host(endpoint.host), endpoint.port),
                                                timeout=min(timeout or CONNECT_TIMEOUT_S, CONNECT_TIMEOUT_S))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if endpoint.kind == "tls":
                    try:
                        sock = ssl_context(endpoint.cafile).wrap_socket(sock, server_hostname=endpoint.server_name)
                    except ssl.SSLError as e:
                        sock.close()
                        raise _tls_error(endpoint, e) from None
        except socket.timeout:
            if sock is not None:
                sock.close()
            raise TimeoutError(f"{endpoint.describe()}: no connection within {CONNECT_TIMEOUT_S:.0f} s") from None
        except OSError as e:
            if sock is not None:
                sock.close()
            raise UnavailableError(f"cannot connect to {endpoint.describe()}: {e.strerror or e}") from None
        self.sock = sock

    def stale(self):
        """An idle connection the server has closed (or sent something unasked on) is not reused."""
        try:
            if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
                return True
            readable, _, _ = select.select([self.sock], [], [], 0)
            return bool(readable)
        except (OSError, ValueError):
            return True

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


class Response:
    """An answer being read. Iterate chunks() (or lines()) for a streamed body, or read() it whole. The
    connection goes back to its pool once the body has been read to its end; close() drops it (the server
    sees the client go: the agent kills a command whose /exec stream is closed)."""

    def __init__(self, pool, conn, parser, head, pending, timeout):
        self._pool = pool
        self._conn = conn
        self._parser = parser
        self.status = head.status
        self.head = head
        self._pending = pending   # payload already parsed with the head
        self._ended = parser.done
        self._timeout = timeout
        if self._ended:
            self._release()

    def header(self, name, default=None):
        return self.head.header(name, default)

    def chunks(self):
        while self._pending:
            yield self._pending.pop(0)
        while not self._ended:
            try:
                data = self._conn.sock.recv(READ_SIZE)
            except socket.timeout:
                self.close()
                raise TimeoutError(f"{self._conn.endpoint.describe()}: no data for {self._timeout:.0f} s") from None
            except OSError as e:
                self.close()
                raise UnavailableError(f"{self._conn.endpoint.describe()}: connection broken: {e}") from None
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

    def read(self, max_bytes):
        out = bytearray()
        for chunk in self.chunks():
            out += chunk
            if len(out) > max_bytes:
                self.close()
                from .errors import LimitError
                raise LimitError(f"{self._conn.endpoint.describe()}: answer larger than {max_bytes} bytes")
        return bytes(out)

    def lines(self, max_line):
        splitter = _http.LineSplitter(max_line)
        for chunk in self.chunks():
            yield from splitter.feed(chunk)
        yield from splitter.rest()

    def _release(self):
        if self._conn is not None:
            conn, self._conn = self._conn, None
            self._pool.put(conn, self._parser.keep_alive)
            self._conn = _Released(conn.endpoint)

    def close(self):
        if self._conn is not None and not isinstance(self._conn, _Released):
            self._conn.close()
            self._conn = _Released(self._conn.endpoint)
        self._ended = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Released:
    def __init__(self, endpoint):
        self.endpoint = endpoint


class Pool:
    """Idle keep-alive connections per endpoint, shared by the threads of one Client."""

    def __init__(self):
        self._idle = {}
        self._lock = threading.Lock()

    def get(self, endpoint, timeout):
        with self._lock:
            idle = self._idle.get(endpoint, [])
            while idle:
                conn = idle.pop()
                if not conn.stale():
                    conn.reused = True
                    return conn
                conn.close()
        return Connection(endpoint, timeout)

    def put(self, conn, keep_alive):
        if not keep_alive:
            conn.close()
            return
        with self._lock:
            idle = self._idle.setdefault(conn.endpoint, [])
            if len(idle) >= MAX_IDLE_PER_ENDPOINT:
                conn.close()
            else:
                conn.reused = False
                idle.append(conn)

    def discard(self, server_name):
        """Closes the idle connections to one TLS name (a sandbox being suspended: the ingress closes them
        anyway, and a request sent on one meanwhile could reach the sandbox and then be cut off)."""
        with self._lock:
            for endpoint in [e for e in self._idle if e.server_name == server_name]:
                for conn in self._idle.pop(endpoint):
                    conn.close()

    def close(self):
        with self._lock:
            for idle in self._idle.values():
                for conn in idle:
                    conn.close()
            self._idle.clear()

    def request(self, endpoint, method, target, headers=(), body=None, timeout=None):
        """Sends the request and reads the answer's head. `body`: None, bytes, or a binary file object
        (streamed with chunked encoding). A reused connection that fails before any answer byte (the server
        closed it while idle, e.g. the proxy on a suspend) is retried once on a new connection; nothing of
        the request can have been acted on then, because no answer had begun."""
        for attempt in (0, 1):
            conn = self.get(endpoint, timeout)
            rewind = None
            if hasattr(body, "read") and hasattr(body, "seek"):
                try:
                    rewind = body.tell()
                except OSError:
                    rewind = None
            try:
                return self._exchange(conn, method, target, headers, body, timeout)
            except _RetryableOnFresh as e:
                conn.close()
                can_rewind = not hasattr(body, "read") or rewind is not None
                if attempt == 0 and conn.reused and can_rewind:
                    if rewind is not None:
                        body.seek(rewind)
                    continue
                raise e.error from None

    def _exchange(self, conn, method, target, headers, body, timeout):
        sock = conn.sock
        sock.settimeout(timeout)
        streamed = hasattr(body, "read")
        payload = b"" if body is None else body
        if streamed:
            head = _http.build_head(method, target, conn.endpoint.host_header, headers, chunked=True)
        else:
            length = len(payload) if body is not None else (0 if method in ("POST", "PUT") else None)
            head = _http.build_head(method, target, conn.endpoint.host_header, headers, content_length=length)
        where = conn.endpoint.describe()
        try:
            if streamed:
                sock.sendall(head)
                while True:
                    data = body.read(UPLOAD_CHUNK)
                    sock.sendall(_http.encode_chunk(data))
                    if not data:
                        break
            else:
                sock.sendall(head + bytes(payload) if len(payload) < UPLOAD_CHUNK else head)
                if len(payload) >= UPLOAD_CHUNK:
                    view = memoryview(payload)
                    for off in range(0, len(view), UPLOAD_CHUNK):
                        sock.sendall(view[off:off + UPLOAD_CHUNK])
        except socket.timeout:
            conn.close()
            raise TimeoutError(f"{where}: sending the request timed out") from None
        except OSError as e:
            # The server may have answered (an error) and closed before reading the whole body: read it.
            if conn.reused:
                raise _RetryableOnFresh(UnavailableError(f"{where}: connection broken: {e}"))
        parser = _http.ResponseParser(no_body=(method == "HEAD"))
        pending = []
        got_any = False
        while parser.head is None:
            try:
                data = sock.recv(READ_SIZE)
            except socket.timeout:
                conn.close()
                raise TimeoutError(f"{where}: no answer within {timeout:.0f} s") from None
            except OSError as e:
                if not got_any:
                    raise _RetryableOnFresh(UnavailableError(f"{where}: connection broken: {e}"))
                conn.close()
                raise UnavailableError(f"{where}: connection broken: {e}") from None
            if not data and not got_any:
                raise _RetryableOnFresh(UnavailableError(f"{where}: the server closed the connection without "
                                                         "answering"))
            got_any = True
            try:
                events = parser.feed(data) if data else parser.eof()
            except ProtocolError as e:
                conn.close()
                raise ProtocolError(f"{where}: {e}") from None
            for kind, value in events:
                if kind == "data":
                    pending.append(value)
        return Response(self, conn, parser, parser.head, pending, timeout)


class _RetryableOnFresh(Exception):
    def __init__(self, error):
        super().__init__(str(error))
        self.error = error
