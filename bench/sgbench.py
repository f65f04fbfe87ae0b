"""What the Python benchmarks share (bench/sandbox_start.py, bench/soak.py): a sandgate-node and a
sandgate-proxy on loopback in a temp dir, with a fresh wildcard certificate, and the node API over its unix
socket. Imported, not run. Run as root (the node makes namespaces and cgroups)."""
import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time

DOMAIN = "sandbox.localhost"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# A sandbox's HTTP/1.1 keep-alive server that answers every request "ok" (asyncio, so thousands of
# connections cost it little): the backend of the benches that measure the proxy, not the application.
OK_SERVER = r'''
import asyncio
async def serve(reader, writer):
    try:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
    except Exception:
        writer.close()
async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", 8080, backlog=4096)
    await server.serve_forever()
asyncio.run(main())
'''


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path, timeout=120):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def stop(proc, timeout_s=20):
    """SIGTERM, then SIGKILL if it has not exited within timeout_s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_for(what, pred, timeout_s, proc=None, log=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            sys.exit(f"{what}: the process exited: {open(log).read()[-2000:] if log else ''}")
        time.sleep(0.05)
    sys.exit(f"{what}: not within {timeout_s} s")


def first_answer(connect, timeout_s=30.0):
    """Seconds until `connect()` gets an answer with status 200, polled every 2 ms."""
    start = time.monotonic()
    deadline = start + timeout_s
    while time.monotonic() < deadline:
        try:
            if connect() == 200:
                return time.monotonic() - start
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(0.002)
    raise RuntimeError("no 200 answer within %.0f s" % timeout_s)


# The body of an upload of N MiB to a sandbox's agent (Cluster.agent): its bytes do not matter.
FILLER_MIB = b"\xa5" * (1 << 20)


def print_ms_table(title, rows):
    """A Markdown table of `rows` ({row: [ms, ...]}): runs, median, min, max."""
    print(f"| {title} | runs | median ms | min | max |")
    print("|---|--:|--:|--:|--:|")
    for row, values in rows.items():
        print(f"| {row} | {len(values)} | {statistics.median(values):.1f} | {min(values):.1f} | {max(values):.1f} |")


class Cluster:
    """Node + proxy (one worker, userspace TLS unless `proxy_toml` says otherwise). IMAGES_DIR in the
    environment reuses a node images dir (e.g. the quickstart's .state/images) so its images are there."""

    def __init__(self, build, name, proxy_toml="", node_toml=""):
        # A TERM (timeout, pkill) unwinds through the caller's `finally: close()` rather than leaving the
        # daemons and their sandboxes behind.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        self.build = os.path.abspath(build)
        self.tmp = tempfile.mkdtemp(prefix=f"sandgate-{name}.")
        self.procs = []
        self.sock = self.tmp + "/node.sock"
        self.env = dict(os.environ, HOME=self.tmp, XDG_CONFIG_HOME=self.tmp + "/xdg")
        self.cli = [self.build + "/cli/sandgate", "--api", "unix:" + self.sock]
        subprocess.run([ROOT + "/deploy/gen-cert.sh", self.tmp + "/tls", DOMAIN], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.ca = self.tmp + "/tls/ca.pem"
        images_dir = os.environ.get("IMAGES_DIR", "")
        with open(self.tmp + "/sandgate.toml", "w") as f:
            f.write(f"""domain = "{DOMAIN}"
node_socket = "unix:{self.sock}"
log_level = "info"
[proxy]
listen = "127.0.0.1:0"
workers = 1
access_log = ""
{proxy_toml}
[[proxy.certificates]]
cert = "{self.tmp}/tls/server.pem"
key = "{self.tmp}/tls/server.key"
[node]
state_dir = "{self.tmp}/state"
on_shutdown = "terminate"
cgroup_name = "sandgate-{name}-{os.getpid()}"
init_path = "{self.build}/noderuntime/sandgate-init"
{"images_dir = '%s'" % images_dir if images_dir else ""}
{node_toml}
""")
        node_log, proxy_log = self.tmp + "/node.log", self.tmp + "/proxy.log"
        self.node = self._start([self.build + "/noderuntime/sandgate-node"], node_log)
        wait_for("sandgate-node", lambda: os.path.exists(self.sock), 30, self.node, node_log)
        self.proxy = self._start([self.build + "/proxy/sandgate-proxy"], proxy_log)
        wait_for("sandgate-proxy", lambda: "ready on" in open(proxy_log).read(), 30, self.proxy, proxy_log)
        line = [l for l in open(proxy_log) if "ready on 127.0.0.1:" in l][0]
        self.port = int(line.split("ready on 127.0.0.1:")[1].split()[0].rstrip(",;"))

    def _start(self, argv, log):
        p = subprocess.Popen(argv + ["--config", self.tmp + "/sandgate.toml"], stdout=open(log, "w"),
                             stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def api(self, method, path, body=None):
        c = UnixHTTPConnection(self.sock)
        c.request(method, path, body=json.dumps(body) if body is not None else None,
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, (json.loads(data) if data else None)

    def agent(self, name, token, method, path, body=None, mib=0, content_type=None):
        """The status of `method path` to sandbox `name`'s agent through the TLS proxy, with its token; with
        `mib`, that many MiB of filler are streamed as the body instead of `body`."""
        tls = ssl.create_default_context(cafile=self.ca)
        raw = socket.create_connection(("127.0.0.1", self.port), timeout=60)
        host = f"{name}.{DOMAIN}"
        conn = http.client.HTTPSConnection(host, self.port, context=tls, timeout=120)
        conn.sock = tls.wrap_socket(raw, server_hostname=host)
        headers = {"Authorization": "Bearer " + token}
        if content_type:
            headers["Content-Type"] = content_type
        if mib:
            headers["Content-Length"] = str(mib << 20)
            conn.putrequest(method, path)
            for k, v in headers.items():
                conn.putheader(k, v)
            conn.endheaders()
            for _ in range(mib):
                conn.send(FILLER_MIB)
        else:
            conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        r.read()
        conn.close()
        return r.status

    def agent_answers(self, name, token, timeout_s=30.0):
        """Seconds until sandbox `name`'s agent answers /health with 200."""
        return first_answer(lambda: self.agent(name, token, "GET", "/health"), timeout_s)

    def ensure_default_image(self):
        if self.api("GET", "/v1/images/default")[0] != 200:
            print("building the default image (mmdebstrap)...", file=sys.stderr)
            subprocess.run(self.cli + ["image", "build", "default", "--packages", "python3"], check=True,
                           env=self.env, stdout=subprocess.DEVNULL)

    def create(self, body):
        """(seconds until the 201, the sandbox JSON)."""
        t0 = time.monotonic()
        status, sb = self.api("POST", "/v1/sandboxes", body)
        if status != 201:
            raise RuntimeError(f"create: {status} {sb}")
        return time.monotonic() - t0, sb

    def delete(self, name):
        status, _ = self.api("DELETE", "/v1/sandboxes/" + name)
        if status != 200:
            raise RuntimeError(f"delete {name}: {status}")

    @classmethod
    def with_qemu(cls, build, name, boot_timeout_ms):
        """A cluster whose node boots QEMU guests from GUEST_DIR (default BUILD/qemu-guest, built with
        deploy/build-guest-image.sh and BUILD's agent when missing)."""
        guest = os.environ.get("GUEST_DIR", build + "/qemu-guest")
        subprocess.run(["bash", ROOT + "/deploy/build-guest-image.sh", guest, build + "/agent/sandgate-agent"],
                       check=True, stdout=subprocess.DEVNULL)
        return cls(build, name, node_toml=f'guest_kernel = "{guest}/vmlinuz"\nguest_initrd = "{guest}/initrd.img"\n'
                                          f'qemu_boot_timeout_ms = {boot_timeout_ms}\nmax_timeout_secs = 86400\n')

    def close(self):
        for p in reversed(self.procs):
            stop(p)
        shutil.rmtree(self.tmp, ignore_errors=True)
