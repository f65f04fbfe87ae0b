"""sandgate._http: request heads and the answer parser, fed whole and byte by byte."""
import unittest

from sandgate import _http
from sandgate.errors import InvalidArgumentError, ProtocolError


def parse(data, split=None, no_body=False, eof=False):
    p = _http.ResponseParser(no_body=no_body)
    events = []
    if split is None:
        events += p.feed(data)
    else:
        for i in range(0, len(data), split):
            events += p.feed(data[i:i + split])
    if eof:
        events += p.eof()
    head = next((v for k, v in events if k == "head"), None)
    body = b"".join(v for k, v in events if k == "data")
    ended = any(k == "end" for k, _ in events)
    return p, head, body, ended


class ResponseParserTest(unittest.TestCase):
    def test_content_length_whole_and_byte_by_byte(self):
        raw = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\nx-a: 2\r\n\r\nhello"
        for split in (None, 1, 3):
            p, head, body, ended = parse(raw, split)
            self.assertEqual((head.status, body, ended, p.keep_alive), (200, b"hello", True, True))
            self.assertEqual(head.header("X-A"), "1, 2")

    def test_chunked_with_extension_and_trailer(self):
        raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n2\r\nde\r\n0\r\nT: v\r\n\r\n"
        for split in (None, 1, 2, 7):
            p, head, body, ended = parse(raw, split)
            self.assertEqual((body, ended, p.keep_alive), (b"abcde", True, True))

    def test_close_delimited_ends_at_eof_and_is_not_kept(self):
        p, head, body, ended = parse(b"HTTP/1.1 200 OK\r\n\r\nall of it", eof=True)
        self.assertEqual((body, ended, p.keep_alive), (b"all of it", True, False))

    def test_connection_close_and_http10_are_not_kept(self):
        self.assertFalse(parse(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")[0].keep_alive)
        self.assertFalse(parse(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n")[0].keep_alive)

    def test_interim_100_is_skipped(self):
        p, head, body, ended = parse(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n{}")
        self.assertEqual((head.status, body), (201, b"{}"))

    def test_head_answer_has_no_body(self):
        p, head, body, ended = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n", no_body=True)
        self.assertTrue(ended)
        self.assertEqual(body, b"")

    def test_limits_and_malformed_answers(self):
        with self.assertRaisesRegex(ProtocolError, "head is larger"):
            parse(b"HTTP/1.1 200 OK\r\nX: " + b"a" * (_http.MAX_HEAD_BYTES + 1))
        with self.assertRaisesRegex(ProtocolError, "more than"):
            parse(b"HTTP/1.1 200 OK\r\n" + b"X: 1\r\n" * (_http.MAX_HEADERS + 1) + b"\r\n")
        with self.assertRaisesRegex(ProtocolError, "chunk size"):
            parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
        with self.assertRaisesRegex(ProtocolError, "CRLF"):
            parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\naXX")
        with self.assertRaisesRegex(ProtocolError, "too long"):
            parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 2000)
        with self.assertRaisesRegex(ProtocolError, "not an HTTP"):
            parse(b"SSH-2.0-OpenSSH\r\n\r\n")
        with self.assertRaisesRegex(ProtocolError, "Content-Length"):
            parse(b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n")
        with self.assertRaisesRegex(ProtocolError, "middle of the answer"):
            parse(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", eof=True)
        with self.assertRaisesRegex(ProtocolError, "before the answer"):
            parse(b"", eof=True)


class RequestTest(unittest.TestCase):
    def test_head_and_chunks(self):
        head = _http.build_head("POST", "/exec", "a.sandbox.localhost:8443", [("X", "1")], content_length=2)
        self.assertEqual(head, b"POST /exec HTTP/1.1\r\nHost: a.sandbox.localhost:8443\r\nX: 1\r\n"
                               b"Content-Length: 2\r\n\r\n")
        self.assertIn(b"Transfer-Encoding: chunked", _http.build_head("PUT", "/f", "h", chunked=True))
        self.assertEqual(_http.encode_chunk(b"abc"), b"3\r\nabc\r\n")
        self.assertEqual(_http.encode_chunk(b""), b"0\r\n\r\n")

    def test_header_injection_refused(self):
        with self.assertRaises(InvalidArgumentError):
            _http.build_head("GET", "/x", "h", [("Authorization", "Bearer a\r\nX: y")])
        with self.assertRaises(InvalidArgumentError):
            _http.build_head("GET", "/x y", "h")
        with self.assertRaises(InvalidArgumentError):
            _http.build_head("GET", "x", "h")


class LineSplitterTest(unittest.TestCase):
    def test_lines_across_chunks_and_limit(self):
        s = _http.LineSplitter(10)
        self.assertEqual(s.feed(b'{"a"'), [])
        self.assertEqual(s.feed(b':1}\n{"b":2}\n{"c"'), [b'{"a":1}', b'{"b":2}'])
        self.assertEqual(s.rest(), [b'{"c"'])
        with self.assertRaisesRegex(ProtocolError, "longer than 10"):
            _http.LineSplitter(10).feed(b"x" * 11)


if __name__ == "__main__":
    unittest.main()
