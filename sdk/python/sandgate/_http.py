"""HTTP/1.1 framing without I/O, shared by the blocking and the asyncio transports: a request's bytes, and a
parser fed the answer's bytes as they arrive that hands back the head and the body's payload (Content-Length,
chunked or close-delimited) piece by piece, so a streamed answer (NDJSON from /exec) is seen as it comes.
Every bound is explicit: an answer past one is a ProtocolError, never unbounded buffering."""
from .errors import ProtocolError, InvalidArgumentError

MAX_HEAD_BYTES = 64 * 1024       # status line + headers; the daemons send a few hundred bytes
MAX_HEADERS = 100
MAX_CHUNK_LINE_BYTES = 1024      # "<hex size>[;ext]\r\n"
MAX_TRAILER_BYTES = 16 * 1024

_FORBIDDEN_IN_HEADER = ("\r", "\n", "\0")


def _check_field(what, value):
    if any(c in value for c in _FORBIDDEN_IN_HEADER):
        raise InvalidArgumentError(f"{what} must not contain CR, LF or NUL: {value!r}")


def build_head(method, target, host, headers=(), content_length=None, chunked=False):
    """The request head's bytes. `headers` is a sequence of (name, value); `content_length` adds that header,
    `chunked` Transfer-Encoding: chunked (the body then goes through encode_chunk)."""
    if not target.startswith("/") or any(c in target for c in " \r\n\t\0"):
        raise InvalidArgumentError(f"request target must be an absolute path without spaces: {target!r}")
    _check_field("host", host)
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    for name, value in headers:
        _check_field(name, name)
        _check_field(name, str(value))
        lines.append(f"{name}: {value}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    elif content_length is not None:
        lines.append(f"Content-Length: {content_length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def encode_chunk(data):
    """One chunk of a chunked body; b"" is the last one."""
    if not data:
        return b"0\r\n\r\n"
    return b"%x\r\n" % len(data) + bytes(data) + b"\r\n"


class Head:
    def __init__(self, status, reason, version, headers):
        self.status = status
        self.reason = reason
        self.version = version
        self.headers = headers  # {lowercase name: value}; a repeated header's values joined with ", "

    def header(self, name, default=None):
        return self.headers.get(name.lower(), default)


_HEAD, _BODY_LENGTH, _BODY_CLOSE, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _DONE = range(8)


class ResponseParser:
    """Feed it bytes with feed() and eof(); each returns a list of events: ("head", Head), ("data", bytes)
    and finally ("end", None). `keep_alive` tells, once ended, whether the connection can carry another
    request. `no_body` is for answers to HEAD."""

    def __init__(self, no_body=False):
        self._buf = bytearray()
        self._state = _HEAD
        self._no_body = no_body
        self._remaining = 0
        self._trailer_bytes = 0
        self.head = None
        self.keep_alive = False
        self.done = False

    def feed(self, data):
        self._buf += data
        events = []
        while self._step(events):
            pass
        return events

    def eof(self):
        """The peer closed the connection."""
        if self._state == _BODY_CLOSE:
            self._state = _DONE
            self.done = True
            return [("end", None)]
        if self._state == _DONE:
            return []
        where = "before the answer's head" if self._state == _HEAD else "in the middle of the answer's body"
        raise ProtocolError(f"the connection closed {where}")

    def _finish(self, events):
        self._state = _DONE
        self.done = True
        events.append(("end", None))
        return False

    def _step(self, events):
        s = self._state
        if s == _HEAD:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > MAX_HEAD_BYTES:
                    raise ProtocolError(f"the answer's head is larger than {MAX_HEAD_BYTES} bytes")
                return False
            if end > MAX_HEAD_BYTES:
                raise ProtocolError(f"the answer's head is larger than {MAX_HEAD_BYTES} bytes")
            raw = bytes(self._buf[:end])
            del self._buf[:end + 4]
            head = self._parse_head(raw)
            if 100 <= head.status < 200:
                return True  # an interim answer (100 Continue): the real one follows
            self.head = head
            events.append(("head", head))
            self._start_body(head)
            if self._state == _DONE:
                events.append(("end", None))
                return False
            return True
        if s == _BODY_LENGTH:
            if not self._buf:
                return False
            take = min(self._remaining, len(self._buf))
            events.append(("data", bytes(self._buf[:take])))
            del self._buf[:take]
            self._remaining -= take
            if self._remaining == 0:
                return self._finish(events)
            return True
        if s == _BODY_CLOSE:
            if self._buf:
                events.append(("data", bytes(self._buf)))
                self._buf.clear()
            return False
        if s == _CHUNK_SIZE:
            nl = self._buf.find(b"\r\n")
            if nl < 0:
                if len(self._buf) > MAX_CHUNK_LINE_BYTES:
                    raise ProtocolError("a chunk size line is too long")
                return False
            line = bytes(self._buf[:nl]).split(b";", 1)[0].strip()
            del self._buf[:nl + 2]
            try:
                size = int(line, 16)
            except ValueError:
                raise ProtocolError(f"malformed chunk size {line[:32]!r}") from None
            if size < 0:
                raise ProtocolError("negative chunk size")
            if size == 0:
                self._state = _TRAILER
            else:
                self._remaining = size
                self._state = _CHUNK_DATA
            return True
        if s == _CHUNK_DATA:
            if not self._buf:
                return False
            take = min(self._remaining, len(self._buf))
            events.append(("data", bytes(self._buf[:take])))
            del self._buf[:take]
            self._remaining -= take
            if self._remaining == 0:
                self._state = _CHUNK_END
            return True
        if s == _CHUNK_END:
            if len(self._buf) < 2:
                return False
            if self._buf[:2] != b"\r\n":
                raise ProtocolError("a chunk does not end with CRLF")
            del self._buf[:2]
            self._state = _CHUNK_SIZE
            return True
        if s == _TRAILER:
            nl = self._buf.find(b"\r\n")
            if nl < 0:
                if len(self._buf) > MAX_TRAILER_BYTES:
                    raise ProtocolError("the answer's trailers are too large")
                return False
            self._trailer_bytes += nl + 2
            if self._trailer_bytes > MAX_TRAILER_BYTES:
                raise ProtocolError("the answer's trailers are too large")
            del self._buf[:nl + 2]
            if nl == 0:
                return self._finish(events)
            return True
        return False

    def _parse_head(self, raw):
        try:
            text = raw.decode("latin-1")
        except UnicodeDecodeError:  # latin-1 decodes every byte; kept for clarity
            raise ProtocolError("undecodable answer head") from None
        lines = text.split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or len(parts[1]) != 3 or not parts[1].isdigit():
            raise ProtocolError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
        if len(lines) - 1 > MAX_HEADERS:
            raise ProtocolError(f"the answer has more than {MAX_HEADERS} headers")
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise ProtocolError(f"malformed answer header {line[:80]!r}")
            key = name.lower()
            value = value.strip()
            headers[key] = headers[key] + ", " + value if key in headers else value
        return Head(int(parts[1]), parts[2] if len(parts) > 2 else "", parts[0], headers)

    def _start_body(self, head):
        connection = head.header("connection", "").lower()
        self.keep_alive = head.version == "HTTP/1.1" and "close" not in connection
        if self._no_body or head.status in (204, 304):
            self._state = _DONE
            self.done = True
            return
        te = head.header("transfer-encoding")
        if te is not None:
            if te.lower().split(",")[-1].strip() != "chunked":
                raise ProtocolError(f"unsupported Transfer-Encoding {te!r}")
            self._state = _CHUNK_SIZE
            return
        cl = head.header("content-length")
        if cl is not None:
            if not cl.isdigit():
                raise ProtocolError(f"malformed Content-Length {cl!r}")
            self._remaining = int(cl)
            if self._remaining == 0:
                self._state = _DONE
                self.done = True
            else:
                self._state = _BODY_LENGTH
            return
        self._state = _BODY_CLOSE
        self.keep_alive = False


class LineSplitter:
    """Splits a byte stream into lines (NDJSON), each at most `max_line` bytes."""

    def __init__(self, max_line):
        self._buf = bytearray()
        self._max = max_line

    def feed(self, data):
        self._buf += data
        lines = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                break
            lines.append(bytes(self._buf[:nl]))
            del self._buf[:nl + 1]
        if len(self._buf) > self._max:
            raise ProtocolError(f"a streamed line is longer than {self._max} bytes")
        for line in lines:
            if len(line) > self._max:
                raise ProtocolError(f"a streamed line is longer than {self._max} bytes")
        return lines

    def rest(self):
        """What is left at the end of the stream (a last line without its newline)."""
        tail = bytes(self._buf)
        self._buf.clear()
        return [tail] if tail.strip() else []
