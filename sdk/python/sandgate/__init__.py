"""sandgate: the Python SDK for sandgate sandboxes (docs/sdk.md).

    from sandgate import Sandbox
    sb = Sandbox.create(name="session-alice", exposed_ports=[8080])
    print(sb.run("python3", ["-c", "print(6*7)"]).stdout)

Configured like the `sandgate` CLI: explicit arguments, else SANDGATE_API, SANDGATE_TOKEN, SANDGATE_CACERT,
SANDGATE_INGRESS, SANDGATE_DOMAIN (sandgate.config). Standard library only."""
from ._protocol import (Checkpoint, CheckpointType, CodeEvent, CommandResult, Context, ExecEvent, Execution,
                        ExecutionError, Result)
from .aio import AsyncClient, AsyncSandbox
from .errors import (ConflictError, InvalidArgumentError, LimitError, NotFoundError, PermissionDeniedError,
                     ProtocolError, SandgateError, TimeoutError, UnauthorizedError, UnavailableError,
                     UnsupportedError)
from .sandbox import Client, Sandbox

__version__ = "0.1.0"

__all__ = [
    "Sandbox", "AsyncSandbox", "Client", "AsyncClient", "CheckpointType", "Checkpoint", "CommandResult",
    "ExecEvent", "Execution", "ExecutionError", "Result", "CodeEvent", "Context",
    "SandgateError", "InvalidArgumentError", "NotFoundError", "ConflictError", "UnauthorizedError",
    "PermissionDeniedError", "LimitError", "TimeoutError", "UnsupportedError", "UnavailableError",
    "ProtocolError",
]
