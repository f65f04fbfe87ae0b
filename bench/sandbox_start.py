#!/usr/bin/env python3
"""Process sandbox start times against a real node + proxy (issue 10's bench, results in bench/RESULTS.md).

    bench/sandbox_start.py BUILD_DIR [RUNS]          (default 5 runs per row; run as root)
    IMAGES_DIR=DIR  reuse a node images dir that has the `default` image (deploy/quickstart.sh's
                    .state/images); without it the image is built here first (mmdebstrap, 1-2 minutes)

Rows (medians of RUNS):
  - create (POST /v1/sandboxes until its 201, the sandbox running) and first HTTP answer through the TLS
    proxy, on the `default` image: the agent route (`https://NAME.sandbox.localhost/health`, Bearer token)
    and `python3 -m http.server` on a public port; the anchor is the same http.server started on the host
    and polled there (no sandbox, no TLS), measured in the same run;
  - create to the agent's first answer on busybox images of 1, 8 and 32 layers (each layer one file): what
    the overlay of idmapped lower layers costs per layer (sandgate-init mounts them after the 201).
First HTTP is polled every 2 ms with a new connection each try (what a client retrying sees).
"""
import hashlib
import http.client
import io
import json
import socket
import ssl
import subprocess
import sys
import tarfile
import time

from sgbench import DOMAIN, Cluster, first_answer, print_ms_table


def busybox_image(path, layers):
    """A docker-save archive: busybox-static as layer 1, then one small file per further layer."""
    def tar_bytes(add):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as t:
            add(t)
        return buf.getvalue()

    def base(t):
        for d in ("bin", "etc", "proc", "dev", "tmp", "sys"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            t.addfile(info)
        t.add("/bin/busybox", "bin/busybox")
        for applet in ("sh", "sleep", "cat", "true"):
            info = tarfile.TarInfo("bin/" + applet)
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            t.addfile(info)

    blobs = [tar_bytes(base)]
    for i in range(1, layers):
        def one(t, i=i):
            data = ("layer %d\n" % i).encode()
            info = tarfile.TarInfo("etc/layer-%d" % i)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        blobs.append(tar_bytes(one))
    diff_ids = ["sha256:" + hashlib.sha256(b).hexdigest() for b in blobs]
    config = json.dumps({"os": "linux", "config": {"Env": ["PATH=/bin"]},
                         "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    members = {config_name: config}
    for i, b in enumerate(blobs):
        members["l%d/layer.tar" % i] = b
    members["manifest.json"] = json.dumps(
        [{"Config": config_name, "Layers": ["l%d/layer.tar" % i for i in range(len(blobs))]}]).encode()
    with tarfile.open(path, "w") as t:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    c = Cluster(sys.argv[1], "start-bench")
    try:
        c.ensure_default_image()
        for n in (1, 8, 32):
            busybox_image(f"{c.tmp}/bb{n}.tar", n)
            subprocess.run(c.cli + ["image", "import", f"{c.tmp}/bb{n}.tar", f"bb{n}"], check=True, env=c.env,
                           stdout=subprocess.DEVNULL)
        port, create, delete, tmp = c.port, c.create, c.delete, c.tmp

        tls = ssl.create_default_context(cafile=c.ca)

        def https_get(host, path, token=None):
            def go():
                raw = socket.create_connection(("127.0.0.1", port), timeout=2)
                conn = http.client.HTTPSConnection(host, port, context=tls, timeout=2)
                conn.sock = tls.wrap_socket(raw, server_hostname=host)
                conn.request("GET", path, headers={"Authorization": "Bearer " + token} if token else {})
                r = conn.getresponse()
                r.read()
                conn.close()
                return r.status
            return go

        rows = {}

        def add(row, value):
            rows.setdefault(row, []).append(value * 1000)

        server = ["python3", "-m", "http.server", "8080", "--bind", "127.0.0.1"]
        for r in range(runs):
            name = f"agent{r}"
            t0 = time.monotonic()
            created, sb = create({"name": name, "command": ["sleep", "infinity"], "timeout_secs": 3600})
            first = first_answer(https_get(f"{name}.{DOMAIN}", "/health", sb["token"]))
            add("default image: create (201, running)", created)
            add("default image: create to first HTTP, agent route", time.monotonic() - t0)
            delete(name)

            name = f"web{r}"
            t0 = time.monotonic()
            created, sb = create({"name": name, "command": server, "timeout_secs": 3600,
                                  "ports": [{"port": 8080, "public": True}]})
            first = first_answer(https_get(f"8080-{name}.{DOMAIN}", "/"))
            add("default image: create to first HTTP, python3 -m http.server (public port)", time.monotonic() - t0)
            delete(name)

            # Anchor: the same server on the host, polled over plain HTTP on its own port.
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                host_port = s.getsockname()[1]
            t0 = time.monotonic()
            p = subprocess.Popen(["python3", "-m", "http.server", str(host_port), "--bind", "127.0.0.1"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp)

            def plain():
                c = http.client.HTTPConnection("127.0.0.1", host_port, timeout=2)
                c.request("GET", "/")
                status = c.getresponse().status
                c.close()
                return status
            first = first_answer(plain)
            add("anchor: python3 -m http.server on the host, start to first HTTP", first)
            p.terminate()
            p.wait()

            # sandgate-init mounts the root after the 201, so the layers' cost shows in the first answer.
            for n in (1, 8, 32):
                name = f"bb{n}-{r}"
                t0 = time.monotonic()
                created, sb = create({"name": name, "image": f"bb{n}", "command": ["sleep", "1000"],
                                      "timeout_secs": 3600})
                first_answer(https_get(f"{name}.{DOMAIN}", "/health", sb["token"]))
                add(f"busybox image, {n} layer{'s' if n > 1 else ''}: create to first HTTP, agent route",
                    time.monotonic() - t0)
                delete(name)
            print(f"run {r + 1}/{runs} done", file=sys.stderr)

        print_ms_table("row", rows)
    finally:
        c.close()


if __name__ == "__main__":
    main()
