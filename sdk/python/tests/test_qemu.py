"""The issue's scripted code-interpreter flow on a QEMU sandbox, through the SDK and the TLS ingress: a CSV
loaded into a pandas DataFrame, a matplotlib plot as image/png and an exception as a structured error, then
run_code state that survives a memory checkpoint into a new sandbox and into two forks that then diverge. The
guest boots a disk made from the test image plus Debian's pandas and matplotlib (tests/e2e/make-data-image.sh),
and serves SSH (ssh, scp, sftp) from its agent. Real QEMU under TCG here, so it skips, loudly, only when the
guest kernel and initramfs cannot be built."""
import base64
import faulthandler
import hashlib
import os
import struct
import subprocess
import sys
import time
import unittest

from cluster import ROOT, Cluster, wait_for

from sandgate import CheckpointType, Client, ConflictError, Sandbox

SUITE_DEADLINE_S = 900  # a cold build of the guest image, an import of the test image, then TCG boots
READY_TIMEOUT_S = 180.0  # a TCG boot of the disk, sanitizer builds included

LOAD = """import pandas as pd
table = pd.read_csv("/root/visits.csv")
print(len(table), "rows")"""
PLOT = """import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(3, 2), dpi=50)
ax.bar(table["city"], table["visits"])
plt.show()"""


def guest_image(build):
    """deploy/build-guest-image.sh into the dir the C++ e2e tests use (built once, reused by its stamp)."""
    out = os.path.join(build, "qemu-guest")
    r = subprocess.run(["bash", ROOT + "/deploy/build-guest-image.sh", out, build + "/agent/sandgate-agent"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        print("\n#### QEMU SDK tests SKIPPED: the guest image cannot be built:\n" + r.stdout + r.stderr,
              file=sys.stderr)
        raise unittest.SkipTest("the guest image cannot be built: " + (r.stdout + r.stderr)[-500:])
    return out


class QemuCodeInterpreterTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        build = os.environ.get("SANDGATE_BUILD_DIR")
        if not build:
            raise unittest.SkipTest("SANDGATE_BUILD_DIR is not set (run through ctest: ctest -R python_sdk_e2e)")
        faulthandler.dump_traceback_later(SUITE_DEADLINE_S, exit=True)
        image = guest_image(build)
        # A store of its own: the memory snapshot's files are written into the node's store.
        cls.cluster = Cluster("sdk-qemu", own_store="data-image", node_config=f"""guest_kernel = "{image}/vmlinuz"
guest_initrd = "{image}/initrd.img"
qemu_boot_timeout_ms = 90000
qemu_boot_attempts = 2""")
        cls.c = Client(env=cls.cluster.sdk_env())

    @classmethod
    def tearDownClass(cls):
        cls.c.close()
        cls.cluster.close()
        faulthandler.cancel_dump_traceback_later()

    def check_ssh_scp_and_sftp(self, sb):
        """OpenSSH's ssh, scp and sftp through `sandgate ssh-config`'s ProxyCommand into the guest, whose agent
        serves SSH (no sshd runs in it; sftp runs the image's sftp-server)."""
        t0 = time.monotonic()
        c, work = self.cluster, self.cluster.tmp + "/ssh"
        os.mkdir(work, 0o700)
        key = work + "/id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
        added = c.cli("ssh-keys", "add", "--name", "flow", key + ".pub")
        self.assertEqual(added.returncode, 0, added.stdout + added.stderr)
        block = c.cli("ssh-config", sb.name, "--ingress", f"127.0.0.1:{c.port}", "--cacert", c.ca)
        self.assertEqual(block.returncode, 0, block.stderr)
        with open(work + "/config", "w") as f:
            f.write(block.stdout)
        host_key = subprocess.run(["ssh-keygen", "-y", "-f", f"{c.tmp}/state/sandboxes/{sb.id}/ssh/host_ed25519"],
                                  check=True, capture_output=True, text=True).stdout
        with open(work + "/known_hosts", "w") as f:
            f.write(f"{sb.name}.sandbox.localhost {host_key}")
        opts = ["-F", work + "/config", "-i", key, "-o", "IdentitiesOnly=yes", "-o", "IdentityAgent=none",
                "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", "-o", "UserKnownHostsFile=" + work + "/known_hosts",
                "-o", "StrictHostKeyChecking=yes"]

        def client(*argv, stdin=None):
            r = subprocess.run(list(argv), env=c.env, input=stdin, capture_output=True, timeout=300)
            self.assertEqual(r.returncode, 0, (argv, r.stdout[-2000:], r.stderr[-2000:]))
            return r.stdout

        self.assertEqual(client("ssh", *opts, sb.name, "hostname; cat /root/visits.csv | wc -l").decode(),
                         f"{sb.name}\n4\n")
        # 10 MiB each way, compared by hash.
        up = os.urandom(10 << 20)
        with open(work + "/up.bin", "wb") as f:
            f.write(up)
        client("scp", *opts, work + "/up.bin", f"{sb.name}:/root/up.bin")
        self.assertEqual(client("ssh", *opts, sb.name, "sha256sum /root/up.bin").decode().split()[0],
                         hashlib.sha256(up).hexdigest())
        client("ssh", *opts, sb.name, "head -c 10485760 /dev/urandom >/root/down.bin")
        want = client("ssh", *opts, sb.name, "sha256sum /root/down.bin").decode().split()[0]
        client("scp", *opts, f"{sb.name}:/root/down.bin", work + "/down.bin")
        with open(work + "/down.bin", "rb") as f:
            self.assertEqual(hashlib.sha256(f.read()).hexdigest(), want)
        listing = client("sftp", *opts, "-b", "-", sb.name,
                         stdin=f"put {work}/up.bin /root/by-sftp.bin\nls -l /root/by-sftp.bin\n"
                               f"get /root/visits.csv {work}/visits.csv\n".encode()).decode()
        self.assertIn(str(10 << 20), listing)
        with open(work + "/visits.csv", "rb") as f:
            self.assertEqual(f.read(), b"city,visits\nOslo,3\nLima,5\nPune,4\n")
        self.step("ssh, scp 10 MiB both ways, sftp", t0)

    def step(self, what, t0):
        print(f"  {what}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)

    def test_state_survives_a_memory_checkpoint_and_forks_diverge(self):
        t0 = time.monotonic()
        sb = Sandbox.create(name="analysis", driver="qemu", image=self.cluster.image, memory_mb=512, timeout_secs=600, client=self.c,
                            ready_timeout_secs=READY_TIMEOUT_S)
        self.step("create (a boot of the test image's disk under TCG)", t0)
        # A port exposed after the create: QEMU forwards it into the running guest (hostfwd_add).
        sb.run("sh", ["-c", "setsid python3 -m http.server 8000 </dev/null >/dev/null 2>&1 &"])
        url = sb.expose(8000)

        def status():
            return subprocess.run(["curl", "-s", "--max-time", "10", "-o", "/dev/null", "-w", "%{http_code}",
                                   "--cacert", self.cluster.ca, "-H", "Authorization: Bearer " + sb.token, url],
                                  capture_output=True, text=True).stdout
        wait_for("http.server in the guest, on a port exposed after create", lambda: status() == "200", 60)
        # Closed, then exposed again: the rule goes from the live QEMU (hostfwd_remove) and comes back.
        sb.unexpose(8000)
        self.assertEqual(status(), "403")
        sb.expose(8000)
        self.assertEqual(status(), "200")
        with open(self.cluster.node_log) as log:
            self.assertNotIn("its forward stays", log.read())  # QEMU removed the rule as asked
        sb.write_file("/root/visits.csv", b"city,visits\nOslo,3\nLima,5\nPune,4\n")
        t1 = time.monotonic()
        loaded = sb.run_code(LOAD, timeout_secs=120)  # pandas' first import, under TCG
        self.step("pandas imported, CSV loaded", t1)
        self.assertEqual((loaded.stdout, loaded.error), ("3 rows\n", None))
        self.assertEqual(sb.run_code("int(table['visits'].sum())").text, "12")
        frame = sb.run_code("table.sort_values('visits', ascending=False)")
        self.assertIn("<table", frame.results[0].html)
        self.assertLess(frame.results[0].html.index("Lima"), frame.results[0].html.index("Oslo"))
        t1 = time.monotonic()
        plot = sb.run_code(PLOT, timeout_secs=120)
        self.step("matplotlib plot", t1)
        self.assertIsNone(plot.error)
        png = base64.b64decode(plot.results[0].png)
        self.assertEqual(png[:8], b"\x89PNG\r\n\x1a\n")
        self.assertEqual(png[12:16], b"IHDR")
        width, height = struct.unpack(">II", png[16:24])
        self.assertTrue(75 <= width <= 160 and 50 <= height <= 110, (width, height))  # ~figsize * dpi, trimmed
        err = sb.run_code("table.loc[7]")
        self.assertEqual(err.error.name, "KeyError")
        self.assertTrue(err.error.traceback)
        named = sb.contexts.create(language="python")
        sb.run_code("branch = 'source'", context=named)

        t1 = time.monotonic()
        snap = sb.checkpoint(checkpoint_type=CheckpointType.MEMORY)
        self.step("memory checkpoint", t1)
        self.assertTrue(snap.snapshot_id.startswith("snap-"))
        self.assertEqual(snap.snapshot.get("type"), "memory")
        # The source went on where it was.
        self.assertEqual(sb.run_code("len(table)").text, "3")

        t1 = time.monotonic()
        restored = Sandbox.create(snapshot_id=snap.snapshot_id, name="analysis-restored", client=self.c,
                                  ready_timeout_secs=READY_TIMEOUT_S)
        self.step("create from the memory snapshot", t1)
        self.assertNotEqual(restored.id, sb.id)
        self.assertEqual(restored.run_code("sorted(table['city'])").text, "['Lima', 'Oslo', 'Pune']")
        self.assertEqual(restored.run_code("type(table).__name__").text, "'DataFrame'")
        self.assertEqual(restored.run_code("branch", context=named).text, "'source'")

        t1 = time.monotonic()
        forks = sb.fork(count=2, name_prefix="branch")
        self.step("fork into two", t1)
        self.assertEqual([f.name for f in forks], ["branch-1", "branch-2"])
        self.assertEqual(len({f.id for f in forks} | {sb.id, restored.id}), 4)
        for i, f in enumerate(forks):
            f.wait_ready(READY_TIMEOUT_S)
            f.run_code(f"factor = {i + 2}\nscaled = [int(v) for v in table['visits'] * factor]")
        self.assertEqual(forks[0].run_code("scaled").text, "[6, 10, 8]")
        self.assertEqual(forks[1].run_code("scaled").text, "[9, 15, 12]")
        self.assertEqual(forks[0].run_code("branch", context=named).text, "'source'")
        # The branches diverged from each other and left the source and the restored sandbox alone.
        for other in (sb, restored):
            self.assertEqual(other.run_code("'scaled' in globals()").text, "False")

        self.check_ssh_scp_and_sftp(sb)

        with self.assertRaises(ConflictError):  # the restored sandbox is still based on it
            self.c.node("DELETE", f"/v1/snapshots/{snap.snapshot_id}", what="snapshot rm")
        for s in forks + [restored, sb]:
            s.terminate()
        self.step("whole flow", t0)
