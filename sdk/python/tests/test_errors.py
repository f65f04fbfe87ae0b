"""sandgate.errors: answers become typed exceptions carrying the daemon's message."""
import builtins
import unittest

from sandgate import errors as E


class ErrorMappingTest(unittest.TestCase):
    def test_node_kinds(self):
        cases = [
            (404, "not_found", E.NotFoundError), (409, "already_exists", E.ConflictError),
            (409, "conflict", E.ConflictError), (400, "unsupported", E.UnsupportedError),
            (400, "invalid_argument", E.InvalidArgumentError), (429, "limit_exceeded", E.LimitError),
            (504, "timeout", E.TimeoutError), (503, "unavailable", E.UnavailableError),
            (401, "unauthorized", E.UnauthorizedError), (403, "permission_denied", E.PermissionDeniedError),
            (500, "internal", E.SandgateError),
        ]
        for status, kind, cls in cases:
            e = E.error_from_answer(status, b'{"error":"%s","message":"why it failed"}' % kind.encode(), "call x")
            self.assertIs(type(e), cls, kind)
            self.assertEqual((e.status, e.kind), (status, kind))
            self.assertEqual(str(e), f"call x: why it failed (HTTP {status})")

    def test_text_answers_map_by_status(self):
        e = E.error_from_answer(401, b"this sandbox port needs its token: Authorization: Bearer <token>\n", "run")
        self.assertIsInstance(e, E.UnauthorizedError)
        self.assertIn("needs its token", str(e))
        self.assertIsInstance(E.error_from_answer(413, b"", "put"), E.LimitError)
        self.assertIsInstance(E.error_from_answer(502, b"", "x"), E.UnavailableError)
        self.assertIs(type(E.error_from_answer(418, b"", "x")), E.SandgateError)

    def test_missing_endpoint_is_unsupported(self):
        e = E.error_from_answer(404, b'{"error":"not_found","message":"no such endpoint: POST /run_code"}', "r")
        self.assertIsInstance(e, E.UnsupportedError)

    def test_builtin_compatible(self):
        self.assertTrue(issubclass(E.TimeoutError, builtins.TimeoutError))
        self.assertTrue(issubclass(E.NotFoundError, LookupError))
        self.assertTrue(issubclass(E.UnavailableError, ConnectionError))
        for cls in (E.NotFoundError, E.ConflictError, E.UnauthorizedError, E.LimitError, E.TimeoutError,
                    E.UnsupportedError):
            self.assertTrue(issubclass(cls, E.SandgateError))
            self.assertEqual(str(cls("m", status=1)), "m")

    def test_long_bodies_are_cut(self):
        e = E.error_from_answer(500, b"x" * 100000, "x")
        self.assertLess(len(str(e)), 1000)


if __name__ == "__main__":
    unittest.main()
