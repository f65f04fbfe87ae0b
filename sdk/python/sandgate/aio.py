"""The asyncio SDK: AsyncClient and AsyncSandbox, the same calls as sandgate.sandbox as coroutines, over
asyncio streams (no thread per session), for many concurrent sessions in one process. Streams are async
iterators: `async for ev in await sb.run(..., stream=True)`."""
import asyncio
import json
import time
import weakref

from . import _protocol as P
from ._aio_transport import Pool
from .config import Settings, load_token, quote_query_path, remove_token, save_token
from .errors import (ConflictError, InvalidArgumentError, ProtocolError, SandgateError, TimeoutError,
                     UnavailableError, error_from_answer)

_POLL_S = 0.05


class AsyncClient:
    """As sandbox.Client; its connections belong to the event loop that made them."""

    def __init__(self, api=None, token=None, cacert=None, ingress=None, domain=None, env=None):
        self.settings = Settings.resolve(api=api, token=token, cacert=cacert, ingress=ingress, domain=domain,
                                         env=env)
        self._env = env
        self._pool = Pool()

    def close(self):
        self._pool.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.close()

    async def node(self, method, path, body=None, what="", timeout=P.NODE_TIMEOUT_S):
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        r = await self._pool.request(P.node_endpoint(self.settings), method, path,
                                     P.node_headers(self.settings, data is not None), data, timeout)
        return P.json_answer(r.status, await r.read(P.MAX_JSON_ANSWER_BYTES), what or f"{method} {path}")

    async def agent(self, ref, token, method, target, body=None, content_type=None, timeout=None):
        return await self._pool.request(P.agent_endpoint(self.settings, ref, token), method, target,
                                        P.agent_headers(token, content_type), body, timeout)

    def sandbox_token(self, ref, explicit=None):
        if explicit:
            return explicit
        if self.settings.operator_token:
            return self.settings.operator_token
        return load_token(ref, self._env)


# Weak: a loop that asyncio.run() has closed takes its client (and its dead connections) with it.
_defaults = weakref.WeakKeyDictionary()


def default_client():
    """One AsyncClient per event loop, made from the environment on first use."""
    loop = asyncio.get_running_loop()
    c = _defaults.get(loop)
    if c is None:
        c = _defaults[loop] = AsyncClient()
    return c


def _client(client, config):
    if client is not None:
        if any(config.values()):
            raise InvalidArgumentError("pass either client= or api=/token=/cacert=/ingress=/domain=, not both")
        return client
    if any(config.values()):
        return AsyncClient(**config)
    return default_client()


class AsyncSandbox:
    def __init__(self, info, client, token=None):
        self.info = info
        self._client = client
        self._token = token
        self.contexts = AsyncContexts(self)

    id = property(lambda self: self.info["id"])
    name = property(lambda self: self.info.get("name"))
    ref = property(lambda self: P.label(self.info))
    state = property(lambda self: self.info.get("state"))

    @property
    def token(self):
        if self._token is None:
            self._token = self._client.sandbox_token(self.ref)
        return self._token

    def __repr__(self):
        return f"AsyncSandbox(id={self.id!r}, name={self.name!r}, state={self.state!r})"

    @classmethod
    async def create(cls, name=None, image=None, cpus=None, memory_mb=None, timeout_secs=None,
                     allow_internet_access=None, exposed_ports=None, snapshot_id=None, command=None, env=None,
                     cwd=None, ports=None, hibernate_after_secs=None, pids_max=None, disk_mb=None, ephemeral=None,
                     driver=None, allow_unauthenticated_access=None, allow_out=None, deny_out=None,
                     wait_ready=True, ready_timeout_secs=P.AGENT_READY_TIMEOUT_S, client=None, api=None,
                     token=None, cacert=None, ingress=None, domain=None):
        c = _client(client, dict(api=api, token=token, cacert=cacert, ingress=ingress, domain=domain))
        body = P.create_body(name=name, image=image, cpus=cpus, memory_mb=memory_mb, timeout_secs=timeout_secs,
                             allow_internet_access=allow_internet_access, exposed_ports=exposed_ports,
                             snapshot_id=snapshot_id, command=command, env=env, cwd=cwd, ports=ports,
                             hibernate_after_secs=hibernate_after_secs, pids_max=pids_max, disk_mb=disk_mb,
                             ephemeral=ephemeral, driver=driver,
                             allow_unauthenticated_access=allow_unauthenticated_access, allow_out=allow_out,
                             deny_out=deny_out)
        info = await c.node("POST", "/v1/sandboxes", body, f"create {name or ''}".strip())
        sandbox_token = info.pop("token", None)
        if sandbox_token:
            save_token(P.label(info), sandbox_token, c._env)
        sb = cls(info, c, sandbox_token)
        if info.get("state") == "failed":
            raise SandgateError(f"sandbox {sb.ref} failed as it started ({info.get('state_reason', '')})")
        if wait_ready and info.get("agent_port") is not None:
            await sb.wait_ready(ready_timeout_secs)
        return sb

    @classmethod
    async def connect(cls, ref, token=None, client=None, api=None, cacert=None, ingress=None, domain=None,
                      operator_token=None):
        c = _client(client, dict(api=api, token=operator_token, cacert=cacert, ingress=ingress, domain=domain))
        info = await c.node("GET", P.sandbox_path(ref), what=f"get {ref}")
        return cls(info, c, token)

    @classmethod
    async def list(cls, client=None, api=None, token=None, cacert=None, ingress=None, domain=None):
        c = _client(client, dict(api=api, token=token, cacert=cacert, ingress=ingress, domain=domain))
        answer = await c.node("GET", "/v1/sandboxes", what="list")
        return [cls(info, c) for info in answer.get("sandboxes", [])]

    async def refresh(self):
        self.info = await self._client.node("GET", P.sandbox_path(self.id), what=f"get {self.ref}")
        return self

    async def wait_ready(self, timeout_secs=P.AGENT_READY_TIMEOUT_S):
        deadline = time.monotonic() + timeout_secs
        while True:
            try:
                r = await self._client.agent(self.ref, self.token, "GET", "/health", timeout=10)
                body = await r.read(P.MAX_JSON_ANSWER_BYTES)
                if r.status == 200:
                    return self
                err = error_from_answer(r.status, body, f"{self.ref}: agent health")
                if not isinstance(err, UnavailableError):
                    raise err
            except UnavailableError as e:
                err = e
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.ref}: the agent did not answer within {timeout_secs:.0f} s ({err})")
            await asyncio.sleep(_POLL_S)

    async def _wait_state(self, wanted, timeout_secs):
        deadline = time.monotonic() + timeout_secs
        while (await self.refresh()).state not in wanted:
            if self.state in ("failed", "terminated"):
                raise ConflictError(f"{self.ref} is {self.state} ({self.info.get('state_reason', '')})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.ref} is still {self.state} after {timeout_secs:.0f} s")
            await asyncio.sleep(_POLL_S)
        return self

    async def suspend(self, wait=True, timeout_secs=P.STATE_TIMEOUT_S):
        self.info = await self._client.node("POST", P.sandbox_path(self.id, "suspend"), what=f"suspend {self.ref}")
        self._client._pool.discard(self._client.settings.sandbox_host(self.ref))
        return await self._wait_state(("suspended",), timeout_secs) if wait else self

    async def resume(self, wait=True, timeout_secs=P.STATE_TIMEOUT_S):
        self.info = await self._client.node("POST", P.sandbox_path(self.id, "resume"), what=f"resume {self.ref}")
        return await self._wait_state(("running",), timeout_secs) if wait else self

    async def terminate(self):
        self.info = await self._client.node("DELETE", P.sandbox_path(self.id), what=f"terminate {self.ref}")
        remove_token(self.ref, self._client._env)
        return self

    kill = terminate

    async def checkpoint(self, checkpoint_type=P.CheckpointType.FILESYSTEM):
        answer = await self._client.node("POST", P.sandbox_path(self.id, "checkpoint"),
                                         P.checkpoint_body(checkpoint_type), what=f"checkpoint {self.ref}")
        return P.checkpoint_from(answer)

    async def fork(self, count=1, name_prefix=None):
        answer = await self._client.node("POST", P.sandbox_path(self.id, "fork"), P.fork_body(count, name_prefix),
                                         what=f"fork {self.ref}")
        forks = []
        for info in answer.get("sandboxes", []):
            tok = info.pop("token", None)
            if tok:
                save_token(P.label(info), tok, self._client._env)
            forks.append(AsyncSandbox(info, self._client, tok))
        return forks

    async def expose(self, port, public=None, protocol=None):
        """The https URL of `port` through the ingress this SDK is configured with, exposing it first when the
        sandbox does not (PUT .../ports/PORT): private (the sandbox token) unless public=True; protocol http1
        (default), h2c or tcp. For a port already exposed, what is given replaces its policy."""
        await self.refresh()
        call = P.expose_request(self.info, port, public, protocol)
        if call is not None:
            self.info = await self._client.node("PUT", call[0], call[1], what=f"expose port {port} of {self.ref}")
        return self._client.settings.url(self._client.settings.sandbox_host(self.ref, int(port)))

    async def unexpose(self, port):
        """Closes an exposed port: new connections to it are refused, and the ones open are closed."""
        self.info = await self._client.node("DELETE", P.sandbox_path(self.id, f"ports/{int(port)}"),
                                          what=f"close port {port} of {self.ref}")

    async def _agent_json(self, method, target, body=None, content_type=None, what="", timeout=60):
        r = await self._client.agent(self.ref, self.token, method, target, body, content_type, timeout)
        return P.json_answer(r.status, await r.read(P.MAX_JSON_ANSWER_BYTES), what)

    async def _agent_stream(self, target, body, what, timeout):
        r = await self._client.agent(self.ref, self.token, "POST", target, body, "application/json", timeout)
        if r.status != 200:
            raise error_from_answer(r.status, await r.read(P.MAX_JSON_ANSWER_BYTES), what)
        return r

    async def run(self, cmd, args=None, stream=False, env=None, cwd=None, stdin=None, timeout_secs=None):
        """As Sandbox.run; with stream=True an async iterator of ExecEvent (the HTTP errors of the start are
        raised by this await, before the iteration)."""
        body = P.exec_body(cmd, args, env, cwd, stdin, timeout_secs)
        read_timeout = timeout_secs + 30 if timeout_secs else None
        r = await self._agent_stream("/exec", body, f"run in {self.ref}", read_timeout)
        if stream:
            return self._exec_events(r)
        collector = P.ExecCollector()
        async for ev in self._exec_events(r):
            collector.add(ev)
        return collector.result()

    async def _exec_events(self, r):
        saw_exit = False
        try:
            async for line in r.lines(P.MAX_EVENT_LINE_BYTES):
                if line.strip():
                    ev = P.exec_event(line)
                    saw_exit = saw_exit or ev.type == "exit"
                    yield ev
        finally:
            r.close()
        if not saw_exit:
            raise ProtocolError(f"run in {self.ref}: the stream ended before the command's exit event")

    async def write_file(self, path, data):
        if isinstance(data, str):
            data = data.encode()
        r = await self._client.agent(self.ref, self.token, "PUT", "/files?path=" + quote_query_path(path), data,
                                     "application/octet-stream", timeout=300)
        body = await r.read(P.MAX_JSON_ANSWER_BYTES)
        if r.status not in (201, 204):
            raise error_from_answer(r.status, body, f"write {path} in {self.ref}")

    async def read_file(self, path, stream=False, max_bytes=P.MAX_READ_FILE_BYTES):
        r = await self._client.agent(self.ref, self.token, "GET", "/files?path=" + quote_query_path(path),
                                     timeout=300)
        if r.status != 200:
            raise error_from_answer(r.status, await r.read(P.MAX_JSON_ANSWER_BYTES), f"read {path} in {self.ref}")
        if stream:
            return r.chunks()
        return await r.read(max_bytes)

    async def run_code(self, code, context=None, stream=False, timeout_secs=None, language=None):
        body = P.run_code_body(code, context, timeout_secs, language)
        read_timeout = timeout_secs + 30 if timeout_secs else None
        r = await self._agent_stream("/run_code", body, f"run_code in {self.ref}", read_timeout)
        if stream:
            return self._code_events(r)
        collector = P.CodeCollector()
        async for ev in self._code_events(r):
            collector.add(ev)
        return collector.result()

    async def _code_events(self, r):
        try:
            async for line in r.lines(P.MAX_EVENT_LINE_BYTES):
                if line.strip():
                    ev = P.code_event(line)
                    yield ev
                    if ev.type == "end":
                        break
        finally:
            r.close()


class AsyncContexts:
    def __init__(self, sandbox):
        self._sb = sandbox

    async def create(self, language="python"):
        answer = await self._sb._agent_json("POST", "/contexts", json.dumps({"language": language}).encode(),
                                            "application/json", f"create a {language} context in {self._sb.ref}")
        return P.context_from(answer, language)

    async def reset(self, context):
        await self._sb._agent_json("POST", f"/contexts/{P.context_id(context)}/reset", b"", "application/json",
                                   f"reset context in {self._sb.ref}")

    async def delete(self, context):
        await self._sb._agent_json("DELETE", f"/contexts/{P.context_id(context)}",
                                   what=f"delete context in {self._sb.ref}")
