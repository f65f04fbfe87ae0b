#!/usr/bin/env python3
"""What the proxy's socket maker costs a worker during a node outage (proxy/socket_maker.h).

    bench/socket_maker.py BUILD [RUNS]

Starts BUILD/proxy/sandgate-proxy --socket-maker as the proxy does (uid nobody, CAP_SYS_ADMIN alone), gives it a
network namespace of its own (unshare -n) vouched for as sandgate-node does (a mark in a directory only root
writes), and times request/answer round trips for 1, 16 (a route's refill) and 64 sockets: RUNS runs of 500
each, the median per run printed. The anchor, in the same run: a request the maker refuses (the script's own
namespace, which nothing vouches for): the round trip and the vouching check, without setns or sockets. The client is this script (Python's sendmsg/recvmsg and closing the
sockets it gets are in the figures), so the proxy's own C++ client costs less. Needs root. Writes only in
a temporary directory of its own.
"""
import array
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    binary = os.path.join(sys.argv[1], "proxy", "sandgate-proxy")
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    work = tempfile.mkdtemp(prefix="sg-socket-maker-")
    os.chmod(work, 0o755)
    vouched = os.path.join(work, "node.sock.netns")
    os.mkdir(vouched)
    os.chmod(vouched, 0o755)
    # A namespace held by a process of its own; its descriptor is what the node would send with spares.
    ready_r, ready_w = os.pipe()
    holder = subprocess.Popen(["unshare", "-n", "sh", "-c", "echo > /dev/fd/%d; exec sleep 600" % ready_w],
                              pass_fds=[ready_w])
    os.close(ready_w)
    os.read(ready_r, 1)
    netns = os.open("/proc/%d/ns/net" % holder.pid, os.O_RDONLY)
    st = os.fstat(netns)
    open(os.path.join(vouched, "%d-%d" % (st.st_dev, st.st_ino)), "w").close()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    maker = subprocess.Popen([binary, "--socket-maker", "65534", "65534", str(os.getpid()), vouched,
                              str(theirs.fileno())], pass_fds=[theirs.fileno()], env={})
    theirs.close()

    own = os.open("/proc/self/ns/net", os.O_RDONLY)

    def ask(count, namespace=netns, expect_error=0):
        ours.sendmsg([struct.pack("II", 1, count)],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [namespace]))])
        msg, ancillary, _, _ = ours.recvmsg(8, socket.CMSG_SPACE(4 * 64))
        error, n = struct.unpack("iI", msg)
        for _, _, data in ancillary:
            for fd in array.array("i", data[: len(data) - len(data) % 4]):
                os.close(fd)
        if error != expect_error or n != (0 if expect_error else count):
            sys.exit("the maker answered error %d with %d sockets" % (error, n))

    def row(label, call):
        for _ in range(50):
            call()
        per_run = []
        for _ in range(runs):
            start = time.perf_counter()
            for _ in range(500):
                call()
            per_run.append((time.perf_counter() - start) / 500 * 1e6)
        print("%-28s median %6.1f us per request (%d runs of 500: %.1f-%.1f)" %
              (label, statistics.median(per_run), runs, min(per_run), max(per_run)))

    try:
        row("anchor: refused, no setns", lambda: ask(1, own, 1))  # EPERM
        for count in (1, 16, 64):
            row("%d sockets" % count, lambda count=count: ask(count))
    finally:
        ours.close()
        maker.wait(timeout=10)
        holder.kill()
        holder.wait()
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
