"""The issue's scripted code-interpreter flow on a QEMU sandbox, through the SDK and the TLS ingress: run_code
state that survives a memory checkpoint into a new sandbox and into two forks that then diverge. The guest
boots the test image's disk (Debian with python3; pandas and matplotlib are not in it, so the "table" is the
csv module's, and rich outputs are checked against the real libraries in the agent's unit tests). Real QEMU
under TCG here, so it skips, loudly, only when the guest kernel and initramfs cannot be built."""
import faulthandler
import os
import subprocess
import sys
import time
import unittest

from cluster import ROOT, Cluster, wait_for

from sandgate import CheckpointType, Client, ConflictError, Sandbox

SUITE_DEADLINE_S = 900  # a cold build of the guest image, an import of the test image, then TCG boots
READY_TIMEOUT_S = 180.0  # a TCG boot of the disk, sanitizer builds included

LOAD = """import csv, io
table = list(csv.DictReader(io.StringIO("city,visits\\nOslo,3\\nLima,5\\nPune,4\\n")))
print(len(table), "rows")"""


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
        cls.cluster = Cluster("sdk-qemu", own_store="test-image", node_config=f"""guest_kernel = "{image}/vmlinuz"
guest_initrd = "{image}/initrd.img"
qemu_boot_timeout_ms = 90000
qemu_boot_attempts = 2""")
        cls.c = Client(env=cls.cluster.sdk_env())

    @classmethod
    def tearDownClass(cls):
        cls.c.close()
        cls.cluster.close()
        faulthandler.cancel_dump_traceback_later()

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
        loaded = sb.run_code(LOAD)
        self.assertEqual((loaded.stdout, loaded.error), ("3 rows\n", None))
        self.assertEqual(sb.run_code("sum(int(r['visits']) for r in table)").text, "12")
        err = sb.run_code("table[7]")
        self.assertEqual(err.error.name, "IndexError")
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
        self.assertEqual(restored.run_code("sorted(r['city'] for r in table)").text, "['Lima', 'Oslo', 'Pune']")
        self.assertEqual(restored.run_code("branch", context=named).text, "'source'")

        t1 = time.monotonic()
        forks = sb.fork(count=2, name_prefix="branch")
        self.step("fork into two", t1)
        self.assertEqual([f.name for f in forks], ["branch-1", "branch-2"])
        self.assertEqual(len({f.id for f in forks} | {sb.id, restored.id}), 4)
        for i, f in enumerate(forks):
            f.wait_ready(READY_TIMEOUT_S)
            f.run_code(f"factor = {i + 2}\nscaled = [int(r['visits']) * factor for r in table]")
        self.assertEqual(forks[0].run_code("scaled").text, "[6, 10, 8]")
        self.assertEqual(forks[1].run_code("scaled").text, "[9, 15, 12]")
        self.assertEqual(forks[0].run_code("branch", context=named).text, "'source'")
        # The branches diverged from each other and left the source and the restored sandbox alone.
        for other in (sb, restored):
            self.assertEqual(other.run_code("'scaled' in globals()").text, "False")

        with self.assertRaises(ConflictError):  # the restored sandbox is still based on it
            self.c.node("DELETE", f"/v1/snapshots/{snap.snapshot_id}", what="snapshot rm")
        for s in forks + [restored, sb]:
            s.terminate()
        self.step("whole flow", t0)
