"""The blocking SDK: Client (settings + keep-alive connections) and Sandbox. Node calls go to the node API
(its unix socket, or api.<domain> through the ingress with the operator token); sandbox calls go through
the ingress to https://<name>.<domain>, the sandbox's agent, with the sandbox's token."""
import json
import threading
import time

from . import _protocol as P
from ._transport import Pool
from .config import Settings, load_token, quote_query_path, remove_token, save_token
from .errors import (ConflictError, InvalidArgumentError, ProtocolError, SandgateError, TimeoutError,
                     UnavailableError, error_from_answer)

_POLL_S = 0.05  # how often a wait re-reads a state; each wait has its own deadline


class Client:
    """Settings (explicit arguments, else the CLI's environment variables, see sandgate.config) and a pool
    of keep-alive connections, shared by every Sandbox made through it. Thread-safe."""

    def __init__(self, api=None, token=None, cacert=None, ingress=None, domain=None, env=None):
        self.settings = Settings.resolve(api=api, token=token, cacert=cacert, ingress=ingress, domain=domain,
                                         env=env)
        self._env = env
        self._pool = Pool()

    def close(self):
        self._pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the node API
    def node(self, method, path, body=None, what="", timeout=P.NODE_TIMEOUT_S):
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        r = self._pool.request(P.node_endpoint(self.settings), method, path,
                               P.node_headers(self.settings, data is not None), data, timeout)
        return P.json_answer(r.status, r.read(P.MAX_JSON_ANSWER_BYTES), what or f"{method} {path}")

    # -- a sandbox's agent
    def agent(self, ref, token, method, target, body=None, content_type=None, timeout=None):
        """The raw answer; the caller checks its status (Sandbox._agent_json, _agent_stream, ...)."""
        return self._pool.request(P.agent_endpoint(self.settings, ref, token), method, target,
                                  P.agent_headers(token, content_type), body, timeout)

    def sandbox_token(self, ref, explicit=None):
        """The token for a sandbox's agent, found as the CLI's ssh-proxy finds it: the argument, else
        SANDGATE_TOKEN (the operator token opens every sandbox), else the saved one."""
        if explicit:
            return explicit
        if self.settings.operator_token:
            return self.settings.operator_token
        return load_token(ref, self._env)


_default = None
_default_lock = threading.Lock()


def default_client():
    """The Client the class methods use when given none, made from the environment on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Client()
        return _default


def _client(client, config):
    if client is not None:
        if any(config.values()):
            raise InvalidArgumentError("pass either client= or api=/token=/cacert=/ingress=/domain=, not both")
        return client
    if any(config.values()):
        return Client(**config)
    return default_client()


class Sandbox:
    """A sandbox on the node. `info` is its sandbox JSON as last read (refresh() reads it again)."""

    def __init__(self, info, client, token=None):
        self.info = info
        self._client = client
        self._token = token
        self.contexts = Contexts(self)

    # -- identity
    @property
    def id(self):
        return self.info["id"]

    @property
    def name(self):
        return self.info.get("name")

    @property
    def ref(self):
        return P.label(self.info)

    @property
    def state(self):
        return self.info.get("state")

    @property
    def token(self):
        if self._token is None:
            self._token = self._client.sandbox_token(self.ref)
        return self._token

    def __repr__(self):
        return f"Sandbox(id={self.id!r}, name={self.name!r}, state={self.state!r})"

    # -- class methods: the node
    @classmethod
    def create(cls, name=None, image=None, cpus=None, memory_mb=None, timeout_secs=None,
               allow_internet_access=None, exposed_ports=None, snapshot_id=None, command=None, env=None,
               cwd=None, ports=None, hibernate_after_secs=None, pids_max=None, disk_mb=None, ephemeral=None,
               driver=None, allow_unauthenticated_access=None, allow_out=None, deny_out=None, wait_ready=True,
               ready_timeout_secs=P.AGENT_READY_TIMEOUT_S, client=None, api=None, token=None, cacert=None,
               ingress=None, domain=None):
        """Creates and starts a sandbox (POST /v1/sandboxes). Its token is saved where the CLI saves it
        (~/.config/sandgate/tokens/<name or id>). With wait_ready (default) it returns once the sandbox's agent
        answers, so run() works at once."""
        c = _client(client, dict(api=api, token=token, cacert=cacert, ingress=ingress, domain=domain))
        body = P.create_body(name=name, image=image, cpus=cpus, memory_mb=memory_mb, timeout_secs=timeout_secs,
                             allow_internet_access=allow_internet_access, exposed_ports=exposed_ports,
                             snapshot_id=snapshot_id, command=command, env=env, cwd=cwd, ports=ports,
                             hibernate_after_secs=hibernate_after_secs, pids_max=pids_max, disk_mb=disk_mb,
                             ephemeral=ephemeral, driver=driver,
                             allow_unauthenticated_access=allow_unauthenticated_access, allow_out=allow_out,
                             deny_out=deny_out)
        info = c.node("POST", "/v1/sandboxes", body, f"create {name or ''}".strip())
        sandbox_token = info.pop("token", None)
        if sandbox_token:
            save_token(P.label(info), sandbox_token, c._env)
        sb = cls(info, c, sandbox_token)
        if info.get("state") == "failed":
            raise SandgateError(f"sandbox {sb.ref} failed as it started ({info.get('state_reason', '')})")
        if wait_ready and info.get("agent_port") is not None:
            sb.wait_ready(ready_timeout_secs)
        return sb

    @classmethod
    def connect(cls, ref, token=None, client=None, api=None, cacert=None, ingress=None, domain=None,
                operator_token=None):
        """The existing sandbox `ref` (name or id). Its agent token: `token`, else SANDGATE_TOKEN, else the
        one saved when it was created (by the SDK or the CLI)."""
        c = _client(client, dict(api=api, token=operator_token, cacert=cacert, ingress=ingress, domain=domain))
        info = c.node("GET", P.sandbox_path(ref), what=f"get {ref}")
        return cls(info, c, token)

    @classmethod
    def list(cls, client=None, api=None, token=None, cacert=None, ingress=None, domain=None):
        """Every sandbox on the node that is not terminated."""
        c = _client(client, dict(api=api, token=token, cacert=cacert, ingress=ingress, domain=domain))
        answer = c.node("GET", "/v1/sandboxes", what="list")
        return [cls(info, c) for info in answer.get("sandboxes", [])]

    # -- lifecycle
    def refresh(self):
        self.info = self._client.node("GET", P.sandbox_path(self.id), what=f"get {self.ref}")
        return self

    def wait_ready(self, timeout_secs=P.AGENT_READY_TIMEOUT_S):
        """Waits until the agent answers /health (a new sandbox's agent needs a moment to listen)."""
        deadline = time.monotonic() + timeout_secs
        while True:
            try:
                r = self._client.agent(self.ref, self.token, "GET", "/health", timeout=10)
                body = r.read(P.MAX_JSON_ANSWER_BYTES)
                if r.status == 200:
                    return self
                err = error_from_answer(r.status, body, f"{self.ref}: agent health")
                if not isinstance(err, UnavailableError):
                    raise err
            except UnavailableError as e:
                err = e
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.ref}: the agent did not answer within {timeout_secs:.0f} s ({err})")
            time.sleep(_POLL_S)

    def _wait_state(self, wanted, timeout_secs):
        deadline = time.monotonic() + timeout_secs
        while self.refresh().state not in wanted:
            if self.state in ("failed", "terminated"):
                raise ConflictError(f"{self.ref} is {self.state} ({self.info.get('state_reason', '')})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.ref} is still {self.state} after {timeout_secs:.0f} s")
            time.sleep(_POLL_S)
        return self

    def suspend(self, wait=True, timeout_secs=P.STATE_TIMEOUT_S):
        """Suspends the sandbox (in memory; the node may hibernate it later). The next call to its agent (or
        resume()) wakes it. With wait, returns once it is suspended."""
        self.info = self._client.node("POST", P.sandbox_path(self.id, "suspend"), what=f"suspend {self.ref}")
        self._client._pool.discard(self._client.settings.sandbox_host(self.ref))
        return self._wait_state(("suspended",), timeout_secs) if wait else self

    def resume(self, wait=True, timeout_secs=P.STATE_TIMEOUT_S):
        self.info = self._client.node("POST", P.sandbox_path(self.id, "resume"), what=f"resume {self.ref}")
        return self._wait_state(("running",), timeout_secs) if wait else self

    def terminate(self):
        """Deletes the sandbox; its saved token goes with it, as with `sandgate rm`."""
        self.info = self._client.node("DELETE", P.sandbox_path(self.id), what=f"terminate {self.ref}")
        remove_token(self.ref, self._client._env)
        return self

    kill = terminate

    def checkpoint(self, checkpoint_type=P.CheckpointType.FILESYSTEM):
        """A snapshot of the sandbox (.snapshot_id); Sandbox.create(snapshot_id=...) starts from it. A type
        the node cannot make raises the node's UnsupportedError."""
        answer = self._client.node("POST", P.sandbox_path(self.id, "checkpoint"), P.checkpoint_body(checkpoint_type),
                                   what=f"checkpoint {self.ref}")
        return P.checkpoint_from(answer)

    def fork(self, count=1, name_prefix=None):
        """`count` sandboxes continuing the running sandbox's processes (a memory checkpoint, then creates from
        it; QEMU sandboxes), named `name_prefix`-1... (default: this sandbox's name + "-fork"). A driver that
        cannot save processes raises the node's UnsupportedError."""
        answer = self._client.node("POST", P.sandbox_path(self.id, "fork"), P.fork_body(count, name_prefix),
                                   what=f"fork {self.ref}")
        forks = []
        for info in answer.get("sandboxes", []):
            tok = info.pop("token", None)
            if tok:
                save_token(P.label(info), tok, self._client._env)
            forks.append(Sandbox(info, self._client, tok))
        return forks

    def expose(self, port, public=None, protocol=None):
        """The https URL of `port` through the ingress this SDK is configured with, exposing it first when the
        sandbox does not (PUT .../ports/PORT): private (the sandbox token) unless public=True; protocol http1
        (default), h2c or tcp. For a port already exposed, what is given replaces its policy."""
        self.refresh()
        call = P.expose_request(self.info, port, public, protocol)
        if call is not None:
            self.info = self._client.node("PUT", call[0], call[1], what=f"expose port {port} of {self.ref}")
        return self._client.settings.url(self._client.settings.sandbox_host(self.ref, int(port)))

    def unexpose(self, port):
        """Closes an exposed port: new connections to it are refused, and the ones open are closed."""
        self.info = self._client.node("DELETE", P.sandbox_path(self.id, f"ports/{int(port)}"),
                                      what=f"close port {port} of {self.ref}")

    # -- the agent
    def _agent_json(self, method, target, body=None, content_type=None, what="", timeout=60):
        r = self._client.agent(self.ref, self.token, method, target, body, content_type, timeout)
        return P.json_answer(r.status, r.read(P.MAX_JSON_ANSWER_BYTES), what)

    def _agent_stream(self, target, body, what, timeout):
        r = self._client.agent(self.ref, self.token, "POST", target, body, "application/json", timeout)
        if r.status != 200:
            raise error_from_answer(r.status, r.read(P.MAX_JSON_ANSWER_BYTES), what)
        return r

    def run(self, cmd, args=None, stream=False, env=None, cwd=None, stdin=None, timeout_secs=None):
        """Runs a command through the agent's /exec. Returns a CommandResult (stdout, stderr, exit_code), or
        with stream=True an iterator of ExecEvent in the order the agent sent them. Leaving a stream early
        closes its connection, and the agent then kills the command."""
        body = P.exec_body(cmd, args, env, cwd, stdin, timeout_secs)
        read_timeout = timeout_secs + 30 if timeout_secs else None
        # The request goes now, so a command that cannot start raises here, even when streaming.
        r = self._agent_stream("/exec", body, f"run in {self.ref}", read_timeout)
        if stream:
            return self._exec_events(r)
        collector = P.ExecCollector()
        for ev in self._exec_events(r):
            collector.add(ev)
        return collector.result()

    def _exec_events(self, r):
        saw_exit = False
        try:
            for line in r.lines(P.MAX_EVENT_LINE_BYTES):
                if line.strip():
                    ev = P.exec_event(line)
                    saw_exit = saw_exit or ev.type == "exit"
                    yield ev
        finally:
            r.close()
        if not saw_exit:
            raise ProtocolError(f"run in {self.ref}: the stream ended before the command's exit event")

    def write_file(self, path, data):
        """Writes `data` (bytes, str, or a binary file object, streamed) to `path` in the sandbox; the file
        appears whole (the agent renames it into place)."""
        if isinstance(data, str):
            data = data.encode()
        r = self._client.agent(self.ref, self.token, "PUT", "/files?path=" + quote_query_path(path), data,
                               "application/octet-stream", timeout=300)
        body = r.read(P.MAX_JSON_ANSWER_BYTES)
        if r.status not in (201, 204):
            raise error_from_answer(r.status, body, f"write {path} in {self.ref}")

    def read_file(self, path, stream=False, max_bytes=P.MAX_READ_FILE_BYTES):
        """The file's bytes; with stream=True an iterator of chunks as they arrive (for large files)."""
        r = self._client.agent(self.ref, self.token, "GET", "/files?path=" + quote_query_path(path), timeout=300)
        if r.status != 200:
            raise error_from_answer(r.status, r.read(P.MAX_JSON_ANSWER_BYTES), f"read {path} in {self.ref}")
        if stream:
            return r.chunks()
        return r.read(max_bytes)

    def run_code(self, code, context=None, stream=False, timeout_secs=None, language=None):
        """Runs code in the sandbox's persistent interpreter (the agent's /run_code): an Execution with .text,
        .results, .error, .stdout, .stderr, or with stream=True an iterator of CodeEvent."""
        body = P.run_code_body(code, context, timeout_secs, language)
        read_timeout = timeout_secs + 30 if timeout_secs else None
        r = self._agent_stream("/run_code", body, f"run_code in {self.ref}", read_timeout)
        if stream:
            return self._code_events(r)
        collector = P.CodeCollector()
        for ev in self._code_events(r):
            collector.add(ev)
        return collector.result()

    def _code_events(self, r):
        try:
            for line in r.lines(P.MAX_EVENT_LINE_BYTES):
                if line.strip():
                    ev = P.code_event(line)
                    yield ev
                    if ev.type == "end":
                        break
        finally:
            r.close()


class Contexts:
    """sb.contexts: the agent's interpreter contexts (independent namespaces)."""

    def __init__(self, sandbox):
        self._sb = sandbox

    def create(self, language="python"):
        answer = self._sb._agent_json("POST", "/contexts", json.dumps({"language": language}).encode(),
                                      "application/json", f"create a {language} context in {self._sb.ref}")
        return P.context_from(answer, language)

    def reset(self, context):
        self._sb._agent_json("POST", f"/contexts/{P.context_id(context)}/reset", b"", "application/json",
                             f"reset context in {self._sb.ref}")

    def delete(self, context):
        self._sb._agent_json("DELETE", f"/contexts/{P.context_id(context)}", what=f"delete context in {self._sb.ref}")


__all__ = ["Client", "Sandbox", "Contexts", "default_client"]
