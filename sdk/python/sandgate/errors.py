"""Typed errors. Every failure the node, the ingress or the agent reports becomes one of these, carrying the
message it sent: the node and the agent answer `{"error": "<kind>", "message": "..."}` (docs/node-api.md,
agent/README.md), the ingress a text/plain line. The kind decides the class when there is one, else the
HTTP status. Each class also derives from the builtin a caller would naturally catch (TimeoutError is a
builtins.TimeoutError, NotFoundError a LookupError, ...), so generic code keeps working."""
import builtins
import json

__all__ = [
    "SandgateError", "InvalidArgumentError", "NotFoundError", "ConflictError", "UnauthorizedError",
    "PermissionDeniedError", "LimitError", "TimeoutError", "UnsupportedError", "UnavailableError",
    "ProtocolError", "error_from_answer",
]

# An error body is a short JSON object or a line of text; more than this is not one, and is cut in messages.
MAX_ERROR_BODY_BYTES = 64 * 1024
_SHOWN_BODY_CHARS = 500


class SandgateError(Exception):
    """Base of every SDK error. `status` is the HTTP status (None when no answer came), `kind` the error
    kind the daemon sent ("not_found", ...; None for the ingress's text answers)."""

    def __init__(self, message, *, status=None, kind=None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.kind = kind

    def __str__(self):
        return self.message


class InvalidArgumentError(SandgateError, ValueError):
    """400: a bad field, name, path or value (the message names it)."""


class NotFoundError(SandgateError, LookupError):
    """404: no such sandbox, snapshot, image, file or context."""


class ConflictError(SandgateError):
    """409: the name exists, or the sandbox's state does not allow the call."""


class UnauthorizedError(SandgateError, PermissionError):
    """401: the token is missing or wrong (the ingress's answer)."""


class PermissionDeniedError(SandgateError, PermissionError):
    """403: port not exposed, file permission denied, a forbidden request."""


class LimitError(SandgateError):
    """429 / 413 / 431: a limit was hit (max sandboxes, body size, concurrent commands, ...)."""


class TimeoutError(SandgateError, builtins.TimeoutError):  # noqa: A001 - the name users expect
    """504 / 408 from a daemon, or no answer within the SDK's own deadline."""


class UnsupportedError(SandgateError, NotImplementedError):
    """The node or agent cannot do this (a memory checkpoint on the process driver, an endpoint this
    node or agent does not have)."""


class UnavailableError(SandgateError, ConnectionError):
    """502 / 503, or nothing answers at the address: the node or the sandbox cannot serve now."""


class ProtocolError(SandgateError):
    """The answer was not what the protocol allows (malformed HTTP, JSON, or a stream cut short)."""


_BY_KIND = {
    "invalid_argument": InvalidArgumentError,
    "not_found": NotFoundError,
    "already_exists": ConflictError,
    "conflict": ConflictError,
    "unsupported": UnsupportedError,
    "permission_denied": PermissionDeniedError,
    "unauthorized": UnauthorizedError,
    "limit_exceeded": LimitError,
    "timeout": TimeoutError,
    "unavailable": UnavailableError,
    "unreachable": UnavailableError,
}

_BY_STATUS = {
    400: InvalidArgumentError,
    401: UnauthorizedError,
    403: PermissionDeniedError,
    404: NotFoundError,
    408: TimeoutError,
    409: ConflictError,
    413: LimitError,
    429: LimitError,
    431: LimitError,
    502: UnavailableError,
    503: UnavailableError,
    504: TimeoutError,
}

# Both the node and the agent answer an unknown path with a 404 `not_found` "no such endpoint: ...": the
# daemon does not have the feature, which is not the same as a missing sandbox.
_NO_ENDPOINT = "no such endpoint"


def error_from_answer(status, body, what):
    """The exception for a non-2xx answer: `status`, the body's bytes, `what` the call ("create demo")."""
    if isinstance(body, (bytes, bytearray)):
        text = bytes(body[:MAX_ERROR_BODY_BYTES]).decode("utf-8", "replace")
    else:
        text = str(body)[:MAX_ERROR_BODY_BYTES]
    kind, message = None, text.strip()
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), str):
        kind = parsed["error"]
        if isinstance(parsed.get("message"), str):
            message = parsed["message"]
    if len(message) > _SHOWN_BODY_CHARS:
        message = message[:_SHOWN_BODY_CHARS] + "..."
    cls = _BY_KIND.get(kind) or _BY_STATUS.get(status) or SandgateError
    if status == 404 and message.startswith(_NO_ENDPOINT):
        cls = UnsupportedError
    shown = f"{what}: {message}" if message else f"{what}: HTTP {status}"
    return cls(f"{shown} (HTTP {status})", status=status, kind=kind)
