"""The SDK against real daemons (tests/cluster.py): every agent call goes through the TLS ingress, verified
against the cluster's CA, with the sandbox's token; node calls go to the node socket, or to api.<domain>
through the ingress with the operator token. Needs SANDGATE_BUILD_DIR (ctest sets it) and root."""
import asyncio
import faulthandler
import json
import hashlib
import os
import socket
import ssl
import stat
import subprocess
import sys
import time
import unittest

from cluster import OPERATOR_TOKEN, Cluster, wait_for


from sandgate import (AsyncClient, AsyncSandbox, CheckpointType, Client, ConflictError, InvalidArgumentError,
                      NotFoundError, Sandbox, UnauthorizedError, UnavailableError, UnsupportedError)

cluster = None
SUITE_DEADLINE_S = 300


def setUpModule():
    global cluster
    if not os.environ.get("SANDGATE_BUILD_DIR"):
        raise unittest.SkipTest("SANDGATE_BUILD_DIR is not set (run through ctest: ctest -R python_sdk_e2e)")
    cluster = Cluster()  # may build the test image first (mmdebstrap, minutes), so the deadline starts after
    # A hang fails the suite with every thread's traceback, well before ctest's own timeout kills it silently.
    faulthandler.dump_traceback_later(SUITE_DEADLINE_S, exit=True)


def tearDownModule():
    for c in _clients:
        c.close()
    if cluster is not None:
        cluster.close()
    faulthandler.cancel_dump_traceback_later()


_clients = []


def client(**extra):
    """A Client configured by the environment a user's shell would have; closed at the end of the module."""
    c = Client(env=cluster.sdk_env(**extra))
    _clients.append(c)
    return c


class TimedTest(unittest.TestCase):
    """Prints each test's duration (stderr): the suite must stay quick, and a slow run should say where."""

    def setUp(self):
        t0 = time.monotonic()
        self.addCleanup(lambda: print(f"  [{self.id()}: {time.monotonic() - t0:.1f} s]", file=sys.stderr, flush=True))


class SyncSandboxTest(TimedTest):
    """One sandbox through its whole life, the way a user's script drives it."""

    def test_lifecycle(self):
        c = client()
        sb = Sandbox.create(name="sdk-life", cpus=1.0, memory_mb=256, timeout_secs=600,
                            allow_internet_access=False, exposed_ports=[8080],
                            command=["python3", "-m", "http.server", "8080", "--bind", "127.0.0.1"], client=c)
        self.assertEqual((sb.name, sb.state), ("sdk-life", "running"))
        self.assertTrue(sb.id.startswith("sb-"))

        # The token is saved where and how the CLI saves it.
        path = cluster.home + "/.config/sandgate/tokens/sdk-life"
        with open(path) as f:
            self.assertEqual(f.read(), sb.token + "\n")
        self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600)
        self.assertEqual(stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode), 0o700)

        r = sb.run("python3", ["-c", "import sys; print(6*7); print('oops', file=sys.stderr); sys.exit(3)"])
        self.assertEqual((r.stdout, r.stderr, r.exit_code), ("42\n", "oops\n", 3))
        self.assertEqual(sb.run("sh", ["-c", "printf '\\377'"]).stdout_bytes, b"\xff")  # exact bytes
        self.assertEqual(sb.run("cat", stdin="piped").stdout, "piped")
        killed = sb.run("sleep", ["30"], timeout_secs=1)  # the agent kills it; the result says so
        self.assertEqual((killed.timed_out, killed.signal, killed.exit_code), (True, 9, None))
        with self.assertRaises(NotFoundError) as missing:  # the agent cannot start it: a 400 before any event
            sb.run("/no/such/binary")
        self.assertEqual((missing.exception.status, missing.exception.kind), (400, "not_found"))
        self.assertIn("/no/such/binary", str(missing.exception))

        # Streaming: events in the order the command made them, each as it happens.
        t0 = time.monotonic()
        seen = []
        for ev in sb.run("sh", ["-c", "for i in 1 2 3 4 5; do echo $i; sleep 0.2; done; echo done >&2"],
                         stream=True):
            seen.append((ev.type, ev.text, time.monotonic() - t0))
        types = [t for t, _, _ in seen]
        self.assertEqual(types[0], "start")
        self.assertEqual(types[-1], "exit")
        self.assertEqual("".join(text for t, text, _ in seen if t == "stdout"), "1\n2\n3\n4\n5\n")
        self.assertEqual("".join(text for t, text, _ in seen if t == "stderr"), "done\n")
        first = next(at for t, text, at in seen if t == "stdout")
        last = seen[-1][2]
        self.assertGreater(last - first, 0.6, "the first line came only with the last: the stream was buffered")

        # A file round trip of a few MiB, hashed on both sides.
        data = os.urandom(5 * 1024 * 1024 + 123)
        digest = hashlib.sha256(data).hexdigest()
        sb.write_file("/tmp/blob.bin", data)
        self.assertEqual(sb.run("sha256sum", ["/tmp/blob.bin"]).stdout.split()[0], digest)
        self.assertEqual(hashlib.sha256(sb.read_file("/tmp/blob.bin")).hexdigest(), digest)
        h, chunks = hashlib.sha256(), 0
        for chunk in sb.read_file("/tmp/blob.bin", stream=True):
            h.update(chunk)
            chunks += 1
        self.assertEqual(h.hexdigest(), digest)
        self.assertGreater(chunks, 1)
        with open(cluster.tmp + "/upload.bin", "wb") as f:
            f.write(data)
        with open(cluster.tmp + "/upload.bin", "rb") as f:
            sb.write_file("/tmp/streamed upload+.bin", f)  # a file object is streamed; odd names are quoted
        self.assertEqual(sb.run("sha256sum", ["/tmp/streamed upload+.bin"]).stdout.split()[0], digest)
        sb.write_file("/tmp/a.csv", "x,y\n1,2\n")
        self.assertEqual(sb.read_file("/tmp/a.csv"), b"x,y\n1,2\n")
        with self.assertRaises(NotFoundError):
            sb.read_file("/tmp/missing")

        # expose: the URL of the port through this ingress, which a real client can open with the token.
        url = sb.expose(8080)
        self.assertEqual(url, f"https://8080-sdk-life.sandbox.localhost:{cluster.port}/")

        def served():
            out = subprocess.run(["curl", "-s", "--max-time", "10", "-o", "/dev/null", "-w", "%{http_code}", "--cacert", cluster.ca,
                                  "-H", "Authorization: Bearer " + sb.token, url], capture_output=True, text=True)
            return out.stdout == "200"
        wait_for("http.server in the sandbox", served, 20)

        # A port the create did not expose: refused at the edge until expose() opens it, with the token, then
        # without one once public, and refused again once closed.
        sb.run("sh", ["-c", "setsid python3 -m http.server 8081 </dev/null >/dev/null 2>&1 &"])
        late = f"https://8081-sdk-life.sandbox.localhost:{cluster.port}/"

        def status(token=None):
            auth = ["-H", "Authorization: Bearer " + token] if token else []
            return subprocess.run(["curl", "-s", "--max-time", "10", "-o", "/dev/null", "-w", "%{http_code}",
                                   "--cacert", cluster.ca, *auth, late], capture_output=True, text=True).stdout
        self.assertEqual(status(sb.token), "403")  # the edge's answer for a port not exposed
        self.assertEqual(sb.expose(8081), late)
        self.assertIn({"port": 8081, "public": False, "protocol": "http1"}, sb.info["ports"])
        wait_for("the port exposed after create", lambda: status(sb.token) == "200", 20)
        self.assertEqual(status(), "401")
        cli = cluster.cli("expose", "sdk-life", "8081", "--public")  # the CLI's way to the same call
        self.assertEqual(cli.returncode, 0, cli.stderr)
        # The node's URL, with the port the proxy is configured with (0 here: the kernel picks it).
        self.assertRegex(cli.stdout, r"^https://8081-sdk-life\.sandbox\.localhost(:\d+)?/ \(public: no token needed\)\n$")
        self.assertEqual(status(), "200")  # no wait: the node's route event dropped the proxy's cached policy
        self.assertEqual(sb.expose(8081), late)  # already so: no change
        self.assertIn({"port": 8081, "public": True, "protocol": "http1"}, sb.info["ports"])
        # A connection open to a port that is closed is closed too (cause port_closed), within a report
        # interval: a public tcp port to a server that greets its connections and holds them open.
        sb.run("sh", ["-c", "setsid python3 -c 'import socket\n"
                            "s = socket.create_server((\"0.0.0.0\", 8082))\n"
                            "held = []\n"
                            "while True:\n"
                            "    c, _ = s.accept()\n"
                            "    c.sendall(b\"hello\\n\")\n"
                            "    held.append(c)' </dev/null >/dev/null 2>&1 &"])
        sb.expose(8082, public=True, protocol="tcp")
        ctx = ssl.create_default_context(cafile=cluster.ca)

        def greeted():  # the server may not listen yet: the edge then answers 502 and closes
            try:
                t = ctx.wrap_socket(socket.create_connection(("127.0.0.1", cluster.port), timeout=10),
                                    server_hostname="8082-sdk-life.sandbox.localhost")
                if t.recv(6) == b"hello\n":
                    return t
                t.close()
            except OSError:
                pass
            return None
        tls = wait_for("a greeting through the public tcp port", greeted, 20)
        sb.unexpose(8082)
        try:
            ended = tls.recv(4096)  # b"" at the end; the proxy may also end it without a close_notify
        except (ssl.SSLError, ConnectionResetError):
            ended = b""
        self.assertEqual(ended, b"", "the connection to the closed port stayed open")
        tls.close()
        wait_for("the access log's port_closed entry",
                 lambda: any(e.get("cause") == "port_closed" and e.get("port") == 8082 for e in cluster.access_log()), 10)

        sb.unexpose(8081)
        self.assertEqual(status(sb.token), "403")
        with self.assertRaises(NotFoundError):
            sb.unexpose(8081)
        with self.assertRaises(InvalidArgumentError):
            sb.expose(8081, protocol="quic")

        # Suspend and resume, then run again; a suspended sandbox is also woken by the next call.
        self.assertEqual(sb.suspend().state, "suspended")
        self.assertEqual(sb.resume().state, "running")
        self.assertEqual(sb.run("echo", ["after resume"]).stdout, "after resume\n")
        sb.suspend()
        self.assertEqual(sb.run("echo", ["woken"]).stdout, "woken\n")
        self.assertEqual(sb.refresh().state, "running")

        # Another client (a new process would be the same) finds it and its saved token.
        again = Sandbox.connect("sdk-life", client=client())
        self.assertEqual(again.run("echo", ["connected"]).stdout, "connected\n")
        self.assertIn("sdk-life", [s.name for s in Sandbox.list(client=c)])

        sb.terminate()
        self.assertEqual(sb.state, "terminated")
        self.assertFalse(os.path.exists(path))
        with self.assertRaises(NotFoundError):
            Sandbox.connect("sdk-life", client=c)
        c.close()

    def test_keep_alive_connections_are_reused(self):
        c = client()
        sb = Sandbox.create(name="sdk-reuse", client=c)
        for i in range(20):
            self.assertEqual(sb.run("echo", [str(i)]).stdout, f"{i}\n")
        sb.terminate()
        c.close()
        # The proxy logs each connection when it ends: the 20 calls (and create's readiness check) were one.
        sni = "sdk-reuse.sandbox.localhost"
        # (A readiness probe's refused connection may be logged first: wait for the one that carried data.)
        wait_for("the connection's access log line",
                 lambda: any(e.get("sni") == sni and e["bytes_in"] > 0 for e in cluster.access_log()), 10)
        entries = [e for e in cluster.access_log() if e.get("sni") == sni]
        forwarded = [e for e in entries if e["bytes_in"] > 0]
        # Other lines can only be readiness probes the ingress answered itself (502: the agent was not yet
        # listening), each closing its connection.
        refused = [e for e in entries if e["bytes_in"] == 0 and e["status"] == 502]
        self.assertEqual((len(forwarded), len(forwarded) + len(refused)), (1, len(entries)), json.dumps(entries))


class CheckpointTest(TimedTest):
    """On a node with a store of its own (a checkpoint writes into it) and a busybox image."""

    def test_checkpoint_restore_and_what_the_node_cannot_do(self):
        own = Cluster("sdk-ckpt", own_store=True)
        try:
            c = Client(env=own.sdk_env())
            self.addCleanup(c.close)
            sb = Sandbox.create(name="sdk-src", client=c)
            sb.write_file("/tmp/state.txt", b"from the checkpoint")
            snap = sb.checkpoint(checkpoint_type=CheckpointType.FILESYSTEM)
            self.assertTrue(snap.snapshot_id.startswith("snap-"))
            self.assertEqual(snap.snapshot["source"]["name"], "sdk-src")
            other = Sandbox.create(snapshot_id=snap.snapshot_id, client=c)  # unnamed: reached by its id
            self.assertIsNone(other.name)
            self.assertEqual(other.read_file("/tmp/state.txt"), b"from the checkpoint")
            self.assertEqual(other.run("cat", ["/tmp/state.txt"]).stdout, "from the checkpoint")
            other.terminate()
            with self.assertRaises(UnsupportedError) as memory:
                sb.checkpoint(checkpoint_type=CheckpointType.MEMORY)
            self.assertIn("memory", str(memory.exception))
            with self.assertRaises(UnsupportedError) as fork:
                sb.fork(count=2)
            self.assertIn("fork", str(fork.exception))
            sb.suspend()
            wait_for("the suspend", lambda: sb.refresh().state == "suspended", 10)
            asleep = sb.checkpoint()  # a suspended sandbox is checkpointed as it is, and stays suspended
            self.assertTrue(asleep.snapshot_id.startswith("snap-"))
            self.assertEqual(sb.refresh().state, "suspended")
            with self.assertRaises(UnsupportedError):
                sb.checkpoint(checkpoint_type=CheckpointType.MEMORY)
            sb.terminate()
            c.close()
        finally:
            own.close()


class ErrorsTest(TimedTest):
    def test_typed_errors_carry_the_message(self):
        c = client()
        with self.assertRaises(NotFoundError) as nf:
            Sandbox.connect("sdk-nobody", client=c)
        self.assertEqual(nf.exception.status, 404)
        self.assertIn("sdk-nobody", str(nf.exception))

        sb = Sandbox.create(name="sdk-dup", client=c)
        with self.assertRaises(ConflictError) as dup:
            Sandbox.create(name="sdk-dup", client=c)
        self.assertEqual(dup.exception.status, 409)

        bad = Sandbox(sb.info, c, token="sgt_not-the-token")
        with self.assertRaises(UnauthorizedError) as unauth:
            bad.run("true")
        self.assertEqual(unauth.exception.status, 401)
        self.assertIn("token", str(unauth.exception))

        with self.assertRaises(InvalidArgumentError):
            Sandbox.create(name="Not_A_Name", client=c)  # refused before it is sent
        with self.assertRaises(InvalidArgumentError) as field:
            Sandbox.create(name="sdk-badfield", pids_max=1, client=c)  # the node's 400 naming the field
        self.assertIn("pids_max", str(field.exception))
        sb.terminate()
        c.close()

    def test_tls_is_verified(self):
        # Without the cluster's CA the ingress's certificate is not trusted: the call fails, never goes on.
        sb = Sandbox.create(name="sdk-tls", client=client(), wait_ready=True)
        untrusted = Sandbox.connect("sdk-tls", client=client(SANDGATE_CACERT=""))
        with self.assertRaisesRegex(UnavailableError, "certificate is not trusted"):
            untrusted.run("true")
        sb.terminate()

    def test_https_api_with_the_operator_token(self):
        https = dict(SANDGATE_API=f"https://api.sandbox.localhost:{cluster.port}", SANDGATE_TOKEN=OPERATOR_TOKEN)
        c = client(**https)
        sb = Sandbox.create(name="sdk-https", client=c)
        self.assertIn("sdk-https", [s.name for s in Sandbox.list(client=c)])
        self.assertEqual(sb.run("echo", ["via api"]).stdout, "via api\n")
        with self.assertRaises(UnauthorizedError):
            Sandbox.list(client=client(**dict(https, SANDGATE_TOKEN="wrong-operator-token")))
        sb.terminate()
        c.close()


class CliInteropTest(TimedTest):
    def test_a_script_configured_like_the_cli(self):
        # The CLI creates (and saves the token); a script with only the environment the quickstart prints
        # connects, runs, and removes it; the CLI then sees it gone.
        r = cluster.cli("create", "--name", "sdk-cli", "--", "sleep", "infinity")
        self.assertEqual(r.returncode, 0, r.stderr)
        script = ("from sandgate import Sandbox\n"
                  "sb = Sandbox.connect('sdk-cli'); sb.wait_ready()\n"
                  "print(sb.run('echo', ['from a script']).stdout, end='')\n"
                  "sb.terminate()\n")
        out = subprocess.run([sys.executable, "-c", script], env=cluster.sdk_env(), capture_output=True,
                             text=True, timeout=60)
        self.assertEqual((out.returncode, out.stdout), (0, "from a script\n"), out.stderr)
        self.assertNotEqual(cluster.cli("get", "sdk-cli").returncode, 0)
        self.assertFalse(os.path.exists(cluster.home + "/.config/sandgate/tokens/sdk-cli"))


class AsyncSandboxTest(TimedTest):
    def test_ten_sessions_concurrently(self):
        async def session(c, i):
            sb = await AsyncSandbox.create(name=f"sdk-async-{i}", client=c)
            data = os.urandom(64 * 1024 + i)
            await sb.write_file(f"/tmp/f{i}", data)
            self.assertEqual(await sb.read_file(f"/tmp/f{i}"), data)
            t0 = time.monotonic()
            r = await sb.run("sh", ["-c", f"sleep 1; echo session {i}"])
            took = time.monotonic() - t0
            self.assertEqual((r.stdout, r.exit_code), (f"session {i}\n", 0))
            lines = [ev.text async for ev in await sb.run("sh", ["-c", "echo a; echo b"], stream=True)
                     if ev.type == "stdout"]
            self.assertEqual("".join(lines), "a\nb\n")
            await sb.suspend()
            self.assertEqual((await sb.run("echo", ["back"])).stdout, "back\n")
            await sb.terminate()
            return t0, took

        async def main():
            c = AsyncClient(env=cluster.sdk_env())
            with self.assertRaises(NotFoundError):
                await AsyncSandbox.connect("sdk-async-none", client=c)
            results = await asyncio.gather(*(session(c, i) for i in range(10)))
            c.close()
            return results

        results = asyncio.run(main())
        # The ten 1 s commands overlapped: every one started before any other had finished.
        starts = [t0 for t0, _ in results]
        ends = [t0 + took for t0, took in results]
        self.assertLess(max(starts), min(ends), "the sessions ran one after the other")


class RunCodeTest(TimedTest):
    """run_code needs an agent that serves /run_code and /contexts; an older agent answers 404 "no such
    endpoint", which the SDK raises as UnsupportedError, and these tests skip."""

    @classmethod
    def setUpClass(cls):
        cls.c = client()
        cls.sb = Sandbox.create(name="sdk-code", client=cls.c)
        try:
            cls.sb.run_code("1")
        except UnsupportedError as e:
            cls.sb.terminate()
            raise unittest.SkipTest(f"this agent has no run_code: {e}")

    @classmethod
    def tearDownClass(cls):
        cls.sb.terminate()
        cls.c.close()

    def test_state_results_and_errors(self):
        sb = self.sb
        first = sb.run_code("x = 6\nprint('defined')")
        self.assertEqual((first.stdout, first.error), ("defined\n", None))
        self.assertEqual(sb.run_code("x * 7").text, "42")
        err = sb.run_code("1 / 0")
        self.assertEqual(err.error.name, "ZeroDivisionError")
        self.assertIn("division by zero", err.error.message)
        self.assertTrue(err.error.traceback)
        self.assertEqual(sb.run_code("x").text, "6")  # the error lost nothing

    def test_stream_order(self):
        events = list(self.sb.run_code("import sys\nfor i in range(3): print(i)\nprint('e', file=sys.stderr)\n'r'",
                                       stream=True))
        self.assertEqual(events[-1].type, "end")
        out = "".join(e.text for e in events if e.type == "stdout")
        self.assertEqual(out, "0\n1\n2\n")
        kinds = [e.type for e in events if e.type != "stdout"]
        self.assertLess(kinds.index("stderr"), kinds.index("result"))

    def test_bash_keeps_its_shell_and_reports_exit_statuses(self):
        sb = self.sb
        self.assertIsNone(sb.run_code("n=6; cd /tmp", language="bash").error)
        self.assertEqual(sb.run_code("echo $((n * 7)) $PWD", language="bash").stdout, "42 /tmp\n")
        failed = sb.run_code("false", language="bash")
        self.assertEqual((failed.error.name, failed.error.message), ("ExitStatus", "exit status 1"))
        shell = sb.contexts.create(language="bash")
        self.assertEqual(shell.language, "bash")
        self.assertEqual(sb.run_code("echo ${n:-unset}", context=shell).stdout, "unset\n")  # a shell of its own
        with self.assertRaises(InvalidArgumentError):
            sb.run_code("1", context=shell, language="python")
        sb.contexts.delete(shell)

    def test_contexts_are_independent(self):
        sb = self.sb
        a, b = sb.contexts.create(language="python"), sb.contexts.create()
        sb.run_code("v = 'a'", context=a)
        sb.run_code("v = 'b'", context=b)
        self.assertEqual(sb.run_code("v", context=a).text, "'a'")
        self.assertEqual(sb.run_code("v", context=b).text, "'b'")
        sb.contexts.reset(a)
        self.assertEqual(sb.run_code("v", context=a).error.name, "NameError")
        sb.contexts.delete(a)
        sb.contexts.delete(b)
        with self.assertRaises(NotFoundError):
            sb.run_code("1", context=a)

    def test_timeout_keeps_the_context(self):
        sb = self.sb
        sb.run_code("kept = 1")
        r = sb.run_code("import time\ntime.sleep(30)", timeout_secs=1)
        self.assertIsNotNone(r.error)
        self.assertEqual(sb.run_code("kept").text, "1")


if __name__ == "__main__":
    unittest.main()
