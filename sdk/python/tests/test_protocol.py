"""sandgate._protocol: request bodies, endpoints, and events into results (exec and run_code)."""
import json
import unittest

from sandgate import _protocol as P
from sandgate.config import Settings
from sandgate.errors import InvalidArgumentError, ProtocolError


class BodiesTest(unittest.TestCase):
    def test_create_body(self):
        body = P.create_body(name="session-alice", image="default", cpus=1.0, memory_mb=1024, timeout_secs=600,
                             allow_internet_access=False, exposed_ports=["8080"], snapshot_id=None)
        self.assertEqual(body, {"name": "session-alice", "image": "default", "cpus": 1.0, "memory_mb": 1024,
                                "timeout_secs": 600, "allow_internet_access": False, "exposed_ports": [8080],
                                "command": P.DEFAULT_COMMAND})
        self.assertNotIn("command", P.create_body(snapshot_id="snap-x"))  # the snapshot's command
        self.assertEqual(P.create_body(command="true")["command"], ["true"])
        with self.assertRaises(InvalidArgumentError):
            P.create_body(nmae="typo")
        with self.assertRaises(InvalidArgumentError):
            P.create_body(name="Bad_Name")

    def test_exec_body(self):
        self.assertEqual(json.loads(P.exec_body("python3", ["-c", "1"], {"K": 1}, "/w", b"in", 5)),
                         {"command": ["python3", "-c", "1"], "env": {"K": "1"}, "cwd": "/w", "stdin": "in",
                          "timeout_secs": 5})
        self.assertEqual(json.loads(P.exec_body(["ls", "/"], None, None, None, None, None)), {"command": ["ls", "/"]})
        with self.assertRaises(InvalidArgumentError):
            P.exec_body(["ls"], ["/"], None, None, None, None)
        with self.assertRaises(InvalidArgumentError):
            P.exec_body("", None, None, None, None, None)

    def test_checkpoint_and_fork(self):
        self.assertEqual(json.loads(P.checkpoint_body(P.CheckpointType.MEMORY)), {"type": "memory"})
        self.assertEqual(json.loads(P.checkpoint_body("filesystem")), {"type": "filesystem"})
        with self.assertRaises(ValueError):
            P.checkpoint_body("disk")
        self.assertEqual(json.loads(P.fork_body(2)), {"count": 2})
        self.assertEqual(json.loads(P.fork_body(3, "b")), {"count": 3, "name_prefix": "b"})
        for bad in (0, P.MAX_FORK_COUNT + 1, "2"):
            with self.assertRaises(InvalidArgumentError):
                P.fork_body(bad)

    def test_endpoints(self):
        s = Settings.resolve(env={"SANDGATE_API": "https://api.d.test:8443", "SANDGATE_TOKEN": "op",
                                  "SANDGATE_INGRESS": "127.0.0.1:9", "SANDGATE_CACERT": "/ca"})
        node = P.node_endpoint(s)
        self.assertEqual((node.kind, node.host, node.port, node.server_name, node.host_header, node.cafile),
                         ("tls", "127.0.0.1", 9, "api.d.test", "api.d.test:8443", "/ca"))
        self.assertIn(("Authorization", "Bearer op"), P.node_headers(s, False))
        agent = P.agent_endpoint(s, "demo")
        self.assertEqual((agent.server_name, agent.host_header, agent.port), ("demo.d.test", "demo.d.test:9", 9))
        unix = Settings.resolve(env={"SANDGATE_API": "unix:/n.sock", "SANDGATE_TOKEN": "op"})
        self.assertEqual(P.node_headers(unix, True), [("Content-Type", "application/json")])  # the socket needs none
        self.assertEqual(s.url(s.sandbox_host("demo", 8080)), "https://8080-demo.d.test:9/")


class ExposeRequestTest(unittest.TestCase):
    INFO = {"id": "sb-abc", "ports": [{"port": 8080, "public": True, "protocol": "h2c"}]}

    def test_a_new_port_is_private_http1_unless_told(self):
        self.assertEqual(P.expose_request(self.INFO, 3000, None, None),
                         ("/v1/sandboxes/sb-abc/ports/3000", {"public": False, "protocol": "http1"}))
        self.assertEqual(P.expose_request(self.INFO, "3000", True, "tcp")[1], {"public": True, "protocol": "tcp"})

    def test_an_exposed_port_keeps_what_is_not_given_and_needs_no_call_when_unchanged(self):
        self.assertIsNone(P.expose_request(self.INFO, 8080, None, None))
        self.assertIsNone(P.expose_request(self.INFO, 8080, True, "h2c"))
        self.assertEqual(P.expose_request(self.INFO, 8080, False, None)[1], {"public": False, "protocol": "h2c"})

    def test_a_port_outside_the_tcp_range_is_refused_before_any_call(self):
        for bad in (0, 65536, -1):
            with self.assertRaises(ValueError):
                P.expose_request(self.INFO, bad, None, None)


class ExecEventsTest(unittest.TestCase):
    def test_events_in_order_into_a_result(self):
        lines = [b'{"type":"start","pid":7}', b'{"type":"stdout","data":"a\\n"}',
                 b'{"type":"stderr","data_b64":"/w=="}', b'{"type":"stdout","data":"b"}',
                 b'{"type":"exit","code":3}']
        events = [P.exec_event(line) for line in lines]
        self.assertEqual([e.type for e in events], ["start", "stdout", "stderr", "stdout", "exit"])
        self.assertEqual(events[2].data, b"\xff")
        c = P.ExecCollector()
        for e in events:
            c.add(e)
        r = c.result()
        self.assertEqual((r.stdout, r.stderr_bytes, r.exit_code, r.pid), ("a\nb", b"\xff", 3, 7))

    def test_signal_timeout_and_broken_streams(self):
        e = P.exec_event(b'{"type":"exit","signal":9,"timed_out":true}')
        self.assertEqual((e.exit_code, e.signal, e.timed_out), (None, 9, True))
        with self.assertRaisesRegex(ProtocolError, "exit event"):
            P.ExecCollector().result()
        with self.assertRaises(ProtocolError):
            P.exec_event(b"not json")
        with self.assertRaises(ProtocolError):
            P.exec_event(b'{"type":"stdout","data_b64":"!!"}')
        self.assertEqual(P.exec_event(b'{"type":"future"}').type, "future")


class CodeEventsTest(unittest.TestCase):
    def test_execution(self):
        lines = [b'{"type":"stdout","data":"hi\\n"}', b'{"type":"display","data":{"image/png":"iVBO","text/plain":"<Figure>"}}',
                 b'{"type":"result","data":{"text/plain":"42"}}', b'{"type":"stderr","text":"w"}',
                 b'{"type":"error","name":"ZeroDivisionError","message":"division by zero","traceback":"l1\\nl2"}',
                 b'{"type":"end"}']
        c = P.CodeCollector()
        for line in lines:
            c.add(P.code_event(line))
        x = c.result()
        self.assertEqual((x.stdout, x.stderr, x.text), ("hi\n", "w", "42"))
        self.assertEqual(x.results[0].png, "iVBO")
        self.assertFalse(x.results[0].is_main_result)
        self.assertEqual((x.error.name, x.error.traceback), ("ZeroDivisionError", ["l1", "l2"]))
        with self.assertRaisesRegex(ProtocolError, "end event"):
            P.CodeCollector().result()

    def test_context_ids(self):
        self.assertEqual(P.context_from({"id": "c1"}, "python"), P.Context("c1", "python"))
        self.assertEqual(P.context_from({"context_id": "c2", "language": "bash"}, "python").language, "bash")
        with self.assertRaises(ProtocolError):
            P.context_from({}, "python")
        for bad in ("", "a/b", "../x", 5):
            with self.assertRaises(InvalidArgumentError):
                P.context_id(bad)
        self.assertEqual(json.loads(P.run_code_body("x", P.Context("c1"), 3, None)),
                         {"code": "x", "context": "c1", "timeout_secs": 3})


if __name__ == "__main__":
    unittest.main()
