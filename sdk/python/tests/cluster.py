"""A sandgate-node and a sandgate-proxy on loopback in a temp dir, started the way tests/e2e/harness.cc and
bench/sgbench.py start them: a fresh CA and wildcard certificate for sandbox.localhost, an operator token
file, the proxy on a kernel-chosen port read back from its ready line, HOME inside the temp dir.

Images. By default the node uses the e2e test image (tests/e2e/tools/make-test-image.sh, cached in
SANDGATE_TEST_IMAGE_DIR) from its shared store, as the e2e harness does (imported into it once, under the
harness's lock, if it is not there yet). A checkpoint writes snapshots and layers into the node's store,
which must not happen to the shared one, so Cluster(own_store=True) gets a store of its own holding a tiny
busybox image made here (importing the 240 MB test image and removing it again would cost ~30 s), and
Cluster(own_store="test-image") one with the test image imported (a guest that needs python3 and a checkpoint),
Cluster(own_store="data-image") one with the test image plus pandas and matplotlib (tests/e2e/make-data-image.sh).
node_config adds lines to the node's section (the QEMU guest's kernel and initramfs, for one).
SANDGATE_BUILD_DIR names the build with the daemons. Run as root (the node makes namespaces and cgroups)."""
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

DOMAIN = "sandbox.localhost"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
OPERATOR_TOKEN = "sgop_sdk-tests-operator-token-0123456789"
START_TIMEOUT_S = 30
IMPORT_TIMEOUT_S = 600  # the first run may build the test image (mmdebstrap)


def wait_for(what, pred, timeout_s, proc=None, log=None):
    """Polls pred every 20 ms until true; raises (with the log's tail) when the deadline passes or the
    process it waits on exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited: {_tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s} s: {_tail(log)}")
        time.sleep(0.02)


def _tail(log):
    if not log or not os.path.exists(log):
        return ""
    with open(log, errors="replace") as f:
        return f.read()[-3000:]


def _read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


class Cluster:
    def __init__(self, name="sdk", own_store=False, node_config=""):
        self.own_store = own_store
        self.node_config = node_config
        self.build = os.path.abspath(os.environ.get("SANDGATE_BUILD_DIR") or os.path.join(ROOT, "build"))
        self.tmp = tempfile.mkdtemp(prefix=f"sandgate-{name}.")
        self.procs = []
        try:
            self._start(name)
        except BaseException:
            self.close()
            raise

    def _phase(self, what):
        """Logs how long each start-up step took (stderr), so a slow start in CI says where it waited."""
        now = time.monotonic()
        print(f"cluster {self.name}: {what} {now - self._t:.1f} s", file=sys.stderr, flush=True)
        self._t = now

    def _start(self, name):
        self.name = name
        self._t = time.monotonic()
        self.sock = self.tmp + "/node.sock"
        self.home = self.tmp + "/home"
        os.mkdir(self.home, 0o700)
        # What the CLI and the SDK read: the same HOME, so tokens saved by one are found by the other.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SANDGATE_") or k == "SANDGATE_TEST_IMAGE_DIR"}
        self.env.update(HOME=self.home, XDG_CONFIG_HOME=self.home + "/.config")
        subprocess.run([ROOT + "/deploy/gen-cert.sh", self.tmp + "/tls", DOMAIN], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.ca = self.tmp + "/tls/ca.pem"
        token_file = self.tmp + "/operator.token"
        with open(os.open(token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(OPERATOR_TOKEN + "\n")
        self.cgroup = f"sandgate-{name}-{os.getpid()}"
        with open(self.tmp + "/sandgate.toml", "w") as f:
            f.write(f"""domain = "{DOMAIN}"
node_socket = "unix:{self.sock}"
operator_token_file = "{token_file}"
log_level = "info"
[proxy]
listen = "127.0.0.1:0"
workers = 2
access_log = "{self.tmp}/access.log"
[[proxy.certificates]]
cert = "{self.tmp}/tls/server.pem"
key = "{self.tmp}/tls/server.key"
[node]
state_dir = "{self.tmp}/state"
on_shutdown = "terminate"
cgroup_name = "{self.cgroup}"
init_path = "{self.build}/noderuntime/sandgate-init"
{self._image_config()}
{self.node_config}
""")
        self.node_log, self.proxy_log = self.tmp + "/node.log", self.tmp + "/proxy.log"
        self._phase("certificate, config and image lookup")
        node = self._spawn([self.build + "/noderuntime/sandgate-node"], self.node_log)
        wait_for("sandgate-node", lambda: "sandgate-node ready" in _read(self.node_log), START_TIMEOUT_S, node,
                 self.node_log)
        self._phase("node ready")
        proxy = self._spawn([self.build + "/proxy/sandgate-proxy"], self.proxy_log)
        line = wait_for("sandgate-proxy", lambda: next((l for l in _read(self.proxy_log).splitlines()
                                                        if "ready on 127.0.0.1:" in l), None),
                        START_TIMEOUT_S, proxy, self.proxy_log)
        self.port = int(line.split("ready on 127.0.0.1:")[1].split()[0].rstrip(",;"))
        self._phase("proxy ready")
        if self.own_store in ("test-image", "data-image"):
            self._import(self.archive, self.image)
        elif self.own_store:
            self._import(self._busybox_image(), "tiny")
        elif not os.path.exists(f"{self.store}/images/{self.image}.json"):
            # As harness.cc's ensure_test_image: one importer at a time, the others find it done.
            with open(self.store + "/../.import-lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not os.path.exists(f"{self.store}/images/{self.image}.json"):
                    self._import(self.archive, self.image)
        self._phase("image imported" if self.own_store else "image present")

    def _image_config(self):
        if self.own_store is True:
            return 'images_dir = ""\ndefault_image = "tiny"'
        cache = os.environ.get("SANDGATE_TEST_IMAGE_DIR") or os.path.join(self.build, "test-image")
        made = subprocess.run(["bash", ROOT + "/tests/e2e/tools/make-test-image.sh", cache], check=True,
                              capture_output=True, text=True, timeout=IMPORT_TIMEOUT_S)
        self.archive = made.stdout.splitlines()[0]
        key = os.path.basename(self.archive)[len("test-image-"):-len(".tar")]
        self.image = "sandgate-test-" + key  # the name the e2e harness gives it
        if self.own_store == "data-image":
            made = subprocess.run(["bash", ROOT + "/tests/e2e/make-data-image.sh", cache], check=True,
                                  capture_output=True, text=True, timeout=IMPORT_TIMEOUT_S)
            self.archive = made.stdout.splitlines()[-1]
            self.image = "sandgate-data-" + os.path.basename(self.archive)[len("data-image-"):-len(".tar")]
        if self.own_store:
            return f'images_dir = ""\ndefault_image = "{self.image}"'
        self.store = cache + "/store"
        os.makedirs(self.store, exist_ok=True)
        return f'images_dir = "{self.store}"\ndefault_image = "{self.image}"'

    def _copy_agent_libraries(self, root):
        """The agent is bind-mounted into every sandbox and runs on the image's libraries. The normal build's
        agent is static and needs none; a sanitizer build's cannot be (ASan has no static runtime), so its
        loader and libraries (ldd) go into this image, which otherwise has only a static busybox."""
        agent = self.build + "/agent/sandgate-agent"
        listed = subprocess.run(["ldd", agent], capture_output=True, text=True)
        if listed.returncode != 0:  # "not a dynamic executable"
            return
        for line in listed.stdout.splitlines():
            words = line.split()
            path = words[2] if len(words) >= 3 and words[1] == "=>" else words[0] if words else ""
            if path.startswith("/"):
                os.makedirs(root + os.path.dirname(path), exist_ok=True)
                shutil.copy(path, root + path)  # follows links: the file the loader opens by this name

    def _busybox_image(self):
        """A one-layer docker-save archive: the host's static busybox (busybox-static) and its applets."""
        work = self.tmp + "/tiny"
        os.makedirs(work + "/root/bin")
        for d in ("dev", "proc", "sys", "tmp", "etc", "root"):
            os.makedirs(f"{work}/root/{d}")
        os.chmod(work + "/root/tmp", 0o1777)
        shutil.copy("/bin/busybox", work + "/root/bin/busybox")
        applets = subprocess.run(["/bin/busybox", "--list"], check=True, capture_output=True, text=True).stdout
        for applet in applets.split():
            if applet != "busybox":
                os.symlink("busybox", f"{work}/root/bin/{applet}")
        self._copy_agent_libraries(work + "/root")
        os.makedirs(work + "/out/l0")
        with tarfile.open(work + "/out/l0/layer.tar", "w", format=tarfile.GNU_FORMAT) as t:
            t.add(work + "/root", arcname=".")
        with open(work + "/out/l0/layer.tar", "rb") as f:
            diff_id = "sha256:" + hashlib.sha256(f.read()).hexdigest()
        config = json.dumps({"os": "linux", "config": {"Env": ["PATH=/bin"], "WorkingDir": "/"},
                             "rootfs": {"type": "layers", "diff_ids": [diff_id]}}).encode()
        config_name = hashlib.sha256(config).hexdigest() + ".json"
        with open(f"{work}/out/{config_name}", "wb") as f:
            f.write(config)
        with open(work + "/out/manifest.json", "w") as f:
            json.dump([{"Config": config_name, "RepoTags": ["tiny:latest"], "Layers": ["l0/layer.tar"]}], f)
        with tarfile.open(work + "/image.tar", "w") as t:
            for entry in sorted(os.listdir(work + "/out")):
                t.add(f"{work}/out/{entry}", arcname=entry)
        return work + "/image.tar"

    def _import(self, archive, name):
        r = self.cli("image", "import", archive, name, timeout=IMPORT_TIMEOUT_S)
        if r.returncode != 0:
            raise RuntimeError(f"image import {name}: {r.stdout}{r.stderr}")

    def _spawn(self, argv, log):
        with open(log, "w") as out:
            p = subprocess.Popen(argv + ["--config", self.tmp + "/sandgate.toml"], stdout=out,
                                 stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def access_log(self):
        """The proxy's access log: one JSON object per connection, written when it ends. A line the proxy is
        still writing (no newline yet: a reader can see a write cut at a page boundary) is left for the next
        read; a finished line that is not JSON fails the test."""
        import json
        text = _read(self.tmp + "/access.log")
        finished = text[:text.rfind("\n") + 1]
        return [json.loads(line) for line in finished.split("\n") if line.strip()]

    @property
    def api(self):
        return "unix:" + self.sock

    def sdk_env(self, **extra):
        """The environment a user's script would have: SANDGATE_API and SANDGATE_CACERT as the quickstart
        prints them, SANDGATE_INGRESS where the proxy listens."""
        env = dict(self.env, SANDGATE_API=self.api, SANDGATE_CACERT=self.ca, SANDGATE_INGRESS=f"127.0.0.1:{self.port}")
        env.update(extra)
        return env

    def cli(self, *args, timeout=60):
        return subprocess.run([self.build + "/cli/sandgate", "--api", self.api, *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def close(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)
