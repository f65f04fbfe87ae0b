"""What the blocking Sandbox and the asyncio AsyncSandbox share: where each call goes (endpoints, headers),
the request bodies, and how the answers and streamed events (the agent's /exec and /run_code NDJSON) become
Python objects. No I/O here, so both front ends behave the same and this is unit-tested on its own."""
import base64
import dataclasses
import enum
import hashlib
import json

from ._transport import Endpoint
from .config import validate_ref
from .errors import InvalidArgumentError, ProtocolError, error_from_answer

MAX_JSON_ANSWER_BYTES = 16 * 1024 * 1024   # a node answer (a list of 1000 sandboxes is ~2 MiB)
MAX_EVENT_LINE_BYTES = 16 * 1024 * 1024    # one streamed event (a base64 PNG from run_code can be large)
MAX_READ_FILE_BYTES = 1 << 30              # read_file() into memory; stream=True for larger files
DEFAULT_COMMAND = ["sleep", "infinity"]    # a sandbox needs a command; this one just keeps it up
NODE_TIMEOUT_S = 120.0                     # a create waits for the driver (a VM boots)
AGENT_READY_TIMEOUT_S = 30.0               # create() waits this long for the agent to answer /health
STATE_TIMEOUT_S = 60.0                     # suspend()/resume() wait this long for the state they asked for
MAX_FORK_COUNT = 64


class CheckpointType(str, enum.Enum):
    FILESYSTEM = "filesystem"
    MEMORY = "memory"


# ---- endpoints -------------------------------------------------------------------------------------------

def node_endpoint(settings):
    api = settings.api
    if api.kind == "unix":
        return Endpoint("unix", path=api.path, host_header="localhost")
    if api.kind == "http":
        host = f"[{api.host}]" if ":" in api.host else api.host
        return Endpoint("tcp", host=api.host, port=api.port, host_header=f"{host}:{api.port}")
    host_header = api.host if api.port == 443 else f"{api.host}:{api.port}"
    host, port = settings.ingress
    return Endpoint("tls", host=host, port=port, server_name=api.host, host_header=host_header,
                    cafile=settings.cacert)


def node_headers(settings, has_body):
    headers = []
    if settings.api.kind != "unix" and settings.operator_token:
        headers.append(("Authorization", "Bearer " + settings.operator_token))
    if has_body:
        headers.append(("Content-Type", "application/json"))
    return headers


def agent_endpoint(settings, ref, token=""):
    name = settings.sandbox_host(ref)
    host, port = settings.ingress
    return Endpoint("tls", host=host, port=port, server_name=name,
                    host_header=name if port == 443 else f"{name}:{port}", cafile=settings.cacert,
                    credential=hashlib.sha256(token.encode()).hexdigest() if token else "")


def agent_headers(token, content_type=None):
    headers = [("Authorization", "Bearer " + token)]
    if content_type:
        headers.append(("Content-Type", content_type))
    return headers


def sandbox_path(ref, action=None):
    validate_ref(ref)
    return f"/v1/sandboxes/{ref}" + (f"/{action}" if action else "")


def expose_request(info, port, public, protocol):
    """(path, body) of the PUT that exposes `port` as asked, or None when it is exposed so already: an
    unspecified `public` / `protocol` keeps what the port has (private http1 for a new one)."""
    port = int(port)
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is not a TCP port (1-65535)")
    current = next((p for p in info.get("ports", []) if p.get("port") == port), None)
    want_public = bool(public) if public is not None else bool(current and current.get("public"))
    want_protocol = protocol or (current or {}).get("protocol") or "http1"
    if current and bool(current.get("public")) == want_public and current.get("protocol", "http1") == want_protocol:
        return None
    return sandbox_path(info["id"], f"ports/{port}"), {"public": want_public, "protocol": want_protocol}


def label(info):
    """How the CLI names a sandbox in its token file and in host names: its name, else its id."""
    return info.get("name") or info["id"]


# ---- answers ---------------------------------------------------------------------------------------------

def json_answer(status, body, what):
    """The parsed JSON of a 2xx answer, else the typed error."""
    if not 200 <= status < 300:
        raise error_from_answer(status, body, what)
    if not body:
        return {}
    try:
        value = json.loads(body)
    except ValueError:
        raise ProtocolError(f"{what}: the answer is not JSON: {body[:200]!r}") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"{what}: the answer is not a JSON object")
    return value


_CREATE_FIELDS = ("name", "command", "env", "cwd", "exposed_ports", "ports", "allow_unauthenticated_access",
                  "timeout_secs", "hibernate_after_secs", "cpus", "memory_mb", "pids_max", "disk_mb", "ephemeral",
                  "driver", "image", "snapshot_id", "allow_internet_access", "allow_out", "deny_out")


def create_body(**fields):
    """The node's create body (docs/node-api.md) from the SDK's keywords; None leaves a field to the node's
    default. Without a command (and no snapshot, which has its own) the sandbox runs DEFAULT_COMMAND."""
    unknown = set(fields) - set(_CREATE_FIELDS)
    if unknown:
        raise InvalidArgumentError(f"unknown create argument(s): {', '.join(sorted(unknown))}")
    body = {k: v for k, v in fields.items() if v is not None}
    if "name" in body:
        validate_ref(body["name"])
    if "exposed_ports" in body:
        body["exposed_ports"] = [int(p) for p in body["exposed_ports"]]
    if isinstance(body.get("command"), str):
        body["command"] = [body["command"]]
    if "command" not in body and "snapshot_id" not in body:
        body["command"] = list(DEFAULT_COMMAND)
    return body


def exec_body(cmd, args, env, cwd, stdin, timeout_secs):
    if isinstance(cmd, (list, tuple)):
        if args:
            raise InvalidArgumentError("pass either a command list or cmd + args, not both")
        command = [str(c) for c in cmd]
    else:
        command = [str(cmd)] + [str(a) for a in (args or [])]
    if not command or not command[0]:
        raise InvalidArgumentError("the command is empty")
    body = {"command": command}
    if env:
        body["env"] = {str(k): str(v) for k, v in env.items()}
    if cwd:
        body["cwd"] = cwd
    if stdin is not None:
        body["stdin"] = stdin.decode() if isinstance(stdin, bytes) else stdin
    if timeout_secs:
        body["timeout_secs"] = int(timeout_secs)
    return json.dumps(body).encode()


def checkpoint_body(checkpoint_type):
    kind = CheckpointType(checkpoint_type).value if not isinstance(checkpoint_type, CheckpointType) \
        else checkpoint_type.value
    return json.dumps({"type": kind}).encode()


@dataclasses.dataclass
class Checkpoint:
    snapshot_id: str
    pause_ms: float
    entries: int
    snapshot: dict


def checkpoint_from(answer):
    return Checkpoint(answer.get("snapshot_id", ""), answer.get("pause_ms", 0.0), answer.get("entries", 0),
                      answer.get("snapshot") or {})


def fork_body(count, name_prefix=None):
    if not isinstance(count, int) or not 1 <= count <= MAX_FORK_COUNT:
        raise InvalidArgumentError(f"fork count must be 1-{MAX_FORK_COUNT}, got {count!r}")
    body = {"count": count}
    if name_prefix is not None:
        body["name_prefix"] = name_prefix
    return json.dumps(body).encode()


# ---- /exec -----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class ExecEvent:
    """One event of sb.run(..., stream=True): "start" (pid), "stdout"/"stderr" (data: the exact bytes),
    "exit" (exit_code, or signal; timed_out when the agent killed it for timeout_secs)."""
    type: str
    data: bytes = b""
    pid: int = None
    exit_code: int = None
    signal: int = None
    timed_out: bool = False

    @property
    def text(self):
        return self.data.decode("utf-8", "replace")


def _event_bytes(ev):
    if "data_b64" in ev:
        try:
            return base64.b64decode(ev["data_b64"], validate=True)
        except ValueError:
            raise ProtocolError("an event's data_b64 is not base64") from None
    data = ev.get("data", ev.get("text", ""))
    return data.encode() if isinstance(data, str) else b""


def parse_json_line(line, what):
    try:
        ev = json.loads(line)
    except ValueError:
        raise ProtocolError(f"{what}: a streamed line is not JSON: {line[:200]!r}") from None
    if not isinstance(ev, dict):
        raise ProtocolError(f"{what}: a streamed line is not a JSON object")
    return ev


def exec_event(line):
    ev = parse_json_line(line, "exec")
    kind = ev.get("type")
    if kind in ("stdout", "stderr"):
        return ExecEvent(kind, data=_event_bytes(ev))
    if kind == "start":
        return ExecEvent("start", pid=ev.get("pid"))
    if kind == "exit":
        return ExecEvent("exit", exit_code=ev.get("code"), signal=ev.get("signal"),
                         timed_out=bool(ev.get("timed_out", False)))
    return ExecEvent(str(kind))  # a newer agent's event: passed on, not dropped


@dataclasses.dataclass
class CommandResult:
    stdout_bytes: bytes
    stderr_bytes: bytes
    exit_code: int
    signal: int = None
    timed_out: bool = False
    pid: int = None

    @property
    def stdout(self):
        return self.stdout_bytes.decode("utf-8", "replace")

    @property
    def stderr(self):
        return self.stderr_bytes.decode("utf-8", "replace")


class ExecCollector:
    def __init__(self):
        self.out, self.err = bytearray(), bytearray()
        self.pid = None
        self.exit = None

    def add(self, ev):
        if ev.type == "stdout":
            self.out += ev.data
        elif ev.type == "stderr":
            self.err += ev.data
        elif ev.type == "start":
            self.pid = ev.pid
        elif ev.type == "exit":
            self.exit = ev

    def result(self):
        if self.exit is None:
            raise ProtocolError("exec: the agent's stream ended before the command's exit event")
        return CommandResult(bytes(self.out), bytes(self.err), self.exit.exit_code, self.exit.signal,
                             self.exit.timed_out, self.pid)


# ---- /run_code -------------------------------------------------------------------------------------------

def run_code_body(code, context, timeout_secs, language):
    if not isinstance(code, str):
        raise InvalidArgumentError("code must be a string")
    body = {"code": code}
    ctx = context_id(context) if context is not None else None
    if ctx:
        body["context"] = ctx
    if language:
        body["language"] = language
    if timeout_secs:
        body["timeout_secs"] = timeout_secs
    return json.dumps(body).encode()


def context_id(context):
    cid = context.id if isinstance(context, Context) else context
    if not isinstance(cid, str) or not cid or any(c in cid for c in "/?#% \r\n"):
        raise InvalidArgumentError(f"not a context id: {cid!r}")
    return cid


@dataclasses.dataclass
class Context:
    id: str
    language: str = "python"


def context_from(answer, language):
    cid = answer.get("id") or answer.get("context_id") or (answer.get("context") or {}).get("id")
    if not isinstance(cid, str) or not cid:
        raise ProtocolError(f"contexts.create: the answer has no context id: {answer!r}")
    return Context(cid, answer.get("language", language))


@dataclasses.dataclass
class ExecutionError:
    name: str
    message: str
    traceback: list

    def __str__(self):
        return f"{self.name}: {self.message}"


@dataclasses.dataclass
class Result:
    """A `result` (the value of the final expression, is_main_result) or a `display` (a rich output). `data`
    maps MIME types to values: "text/plain", "image/png" (base64), "text/html", "application/json"."""
    data: dict
    is_main_result: bool = False

    @property
    def text(self):
        return self.data.get("text/plain")

    @property
    def png(self):
        return self.data.get("image/png")

    @property
    def html(self):
        return self.data.get("text/html")


@dataclasses.dataclass
class CodeEvent:
    """One event of run_code(..., stream=True): "stdout"/"stderr" (text), "result"/"display" (result),
    "error" (error), "end"."""
    type: str
    text: str = ""
    result: Result = None
    error: ExecutionError = None


def code_event(line):
    ev = parse_json_line(line, "run_code")
    kind = ev.get("type", ev.get("event"))
    if kind in ("stdout", "stderr"):
        return CodeEvent(kind, text=_event_bytes(ev).decode("utf-8", "replace"))
    if kind in ("result", "display"):
        data = ev.get("data")
        if not isinstance(data, dict):
            data = {"text/plain": data if isinstance(data, str) else ev.get("text", "")}
        return CodeEvent(kind, result=Result(data, kind == "result"))
    if kind == "error":
        tb = ev.get("traceback", [])
        if isinstance(tb, str):
            tb = tb.splitlines()
        return CodeEvent("error", error=ExecutionError(str(ev.get("name", "")), str(ev.get("message", "")), tb))
    return CodeEvent(str(kind))


@dataclasses.dataclass
class Execution:
    stdout: str = ""
    stderr: str = ""
    results: list = dataclasses.field(default_factory=list)
    error: ExecutionError = None

    @property
    def text(self):
        """The final expression's text/plain, as a REPL would print it (None when there was none)."""
        for r in self.results:
            if r.is_main_result:
                return r.text
        return None


class CodeCollector:
    def __init__(self):
        self.execution = Execution()
        self.ended = False
        self._out, self._err = [], []

    def add(self, ev):
        if ev.type == "stdout":
            self._out.append(ev.text)
        elif ev.type == "stderr":
            self._err.append(ev.text)
        elif ev.type in ("result", "display"):
            self.execution.results.append(ev.result)
        elif ev.type == "error":
            self.execution.error = ev.error
        elif ev.type == "end":
            self.ended = True

    def result(self):
        if not self.ended:
            raise ProtocolError("run_code: the agent's stream ended before its end event")
        self.execution.stdout = "".join(self._out)
        self.execution.stderr = "".join(self._err)
        return self.execution
