# The interpreter side of the agent's run_code (docs/code-interpreter.md). The agent starts one python3 per
# context as `python3 -c <this file> MAX_EVENT_BYTES LANGUAGE`; this file is compiled into the agent, so an
# image needs nothing beyond python3 (and bash, for a bash context: its cells run in one bash this process
# keeps, section "bash" below). It talks to the agent over two pipes that are not the code's stdout: fd 3 brings
# requests, fd 4 takes events, both framed as a 4-byte big-endian length and a UTF-8 JSON object. Only the
# standard library is imported here; matplotlib and pandas are used when the user's code imports them.
import ast
import base64
import builtins
import codecs
import importlib.abc
import importlib.util
import io
import json
import linecache
import os
import select
import signal
import struct
import sys
import threading
import traceback

REQUESTS_FD, EVENTS_FD = 3, 4
MAX_EVENT_BYTES = int(sys.argv[1])
LANGUAGE = sys.argv[2] if len(sys.argv) > 2 else "python"
# The cells kept for tracebacks (linecache): enough to show recent code, bounded however long a context lives.
KEPT_CELLS = 200

# Not inherited by what the code runs (os.system, subprocess): only this process speaks the protocol.
os.set_inheritable(REQUESTS_FD, False)
os.set_inheritable(EVENTS_FD, False)
sys.argv = [""]

# Every frame goes out under this lock, after what fd 1 and 2 hold has gone out (_Capture): one order for
# the code's own output and what the programs it runs write. Reentrant: draining sends frames itself.
_order_lock = threading.RLock()
_draining = False
_captures = []
_in_run = False


def _send_raw(payload):
    # SIGINT (the agent's timeout) is blocked while a frame is written: a KeyboardInterrupt in the middle of
    # one would leave half a frame on the pipe and break the protocol for good. It is delivered right after.
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        with _order_lock:
            if not _draining:
                _drain_all()
            data = struct.pack(">I", len(payload)) + payload
            while data:
                data = data[os.write(EVENTS_FD, data):]
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _Capture:
    # fd 1 or 2 of this process, where os.system, subprocesses and C code write: a pipe this process reads
    # itself (a thread, as it comes; and before each of its own frames, all there is), so that output leaves on
    # the event pipe in the order it was written relative to the code's own events. Two pipes the agent read
    # side by side could not say which came first: a print() followed by os.system("echo") could arrive
    # swapped. Between the two captures (a program's stdout against its stderr) the order is as read.
    def __init__(self, fd, name):
        r, w = os.pipe()
        os.dup2(w, fd)  # inheritable: the programs the code starts write here
        os.close(w)
        os.set_blocking(r, False)
        self.read_fd = r
        self.name = name
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def drain(self):
        chunks = []
        while True:
            try:
                chunk = os.read(self.read_fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        if chunks:
            text = self._decoder.decode(b"".join(chunks))
            if text and _in_run:
                send({"type": self.name, "data": text})


def _capture_output():
    for fd, name in ((1, "stdout"), (2, "stderr")):
        _captures.append(_Capture(fd, name))
    poller = select.poll()
    for capture in _captures:
        poller.register(capture.read_fd, select.POLLIN)

    def pump():
        by_fd = {c.read_fd: c for c in _captures}
        while True:
            for fd, _ in poller.poll():
                with _order_lock:
                    _drain_all(by_fd[fd])

    threading.Thread(target=pump, name="sandgate-output", daemon=True).start()


def _drain_all(only=None):
    # Under _order_lock: what the captures hold (or `only` one of them) goes out as frames; their own frames
    # do not drain again.
    global _draining
    _draining = True
    try:
        for capture in [only] if only is not None else _captures:
            capture.drain()
    finally:
        _draining = False


def _encode(event):
    # 'replace': a lone surrogate in a str is not UTF-8; the agent must get valid JSON whatever the code printed.
    return json.dumps(event, ensure_ascii=False).encode("utf-8", "replace")


def _note(mime, size):
    return "[sandgate: %s output of %d bytes dropped: an event is at most %d bytes]" % (mime, size, MAX_EVENT_BYTES)


def send(event):
    payload = _encode(event)
    if len(payload) <= MAX_EVENT_BYTES:
        return _send_raw(payload)
    kind = event.get("type")
    if kind in ("stdout", "stderr"):
        # Long text goes out as several events, in order.
        text = event["data"]
        if len(text) > 1:
            half = len(text) // 2
            send({"type": kind, "data": text[:half]})
            send({"type": kind, "data": text[half:]})
            return None
    elif kind in ("result", "display"):
        # Drop the largest forms until it fits; text/plain says what was dropped.
        data = dict(event["data"])
        notes = []
        for mime in sorted(data, key=lambda m: -len(_encode(data[m]))):
            if len(_encode({"type": kind, "data": data})) <= MAX_EVENT_BYTES - 1024:
                break
            notes.append(_note(mime, len(_encode(data[mime]))))
            del data[mime]
        data["text/plain"] = "\n".join([data.get("text/plain", "")[:1024]] + notes).strip()
        return _send_raw(_encode({"type": kind, "data": data}))
    elif kind == "error":
        keep = max(MAX_EVENT_BYTES // 4, 16)
        tb = event.get("traceback", [])
        small = {"type": "error", "name": str(event.get("name", ""))[:256],
                 "message": str(event.get("message", ""))[:keep],
                 "traceback": [line[:1024] for line in tb[:16]] + ["[sandgate: traceback truncated]"]}
        return _send_raw(_encode(small))
    return _send_raw(_encode({"type": "stderr", "data": _note(str(kind), len(payload)) + "\n"}))


class _Bytes(io.RawIOBase):
    # sys.stdout.buffer: bytes written there are text to the stream (invalid UTF-8 replaced).
    def __init__(self, text):
        super().__init__()
        self._text = text

    def writable(self):
        return True

    def write(self, b):
        self._text.write(bytes(b).decode("utf-8", "replace"))
        return len(b)

    def flush(self):
        self._text.flush()


class _Stream(io.TextIOBase):
    # sys.stdout and sys.stderr of the code: each write goes out as an event on the event pipe, so stdout and
    # stderr keep their relative order. Text is held only until a newline (like a terminal's line buffering),
    # a switch to the other stream, a display, or the end of the run.
    def __init__(self, name, fd, other=None):
        super().__init__()
        self._name = name
        self._fd = fd
        self._buf = []
        self.other = other
        self.buffer = _Bytes(self)

    def fileno(self):
        # The real fd (a _Capture): subprocess.run(stdout=sys.stdout) and faulthandler write there.
        self.flush()
        return self._fd

    @property
    def encoding(self):
        return "utf-8"

    def writable(self):
        return True

    def isatty(self):
        return False

    def write(self, s):
        if not isinstance(s, str):
            raise TypeError("write() argument must be str, not %s" % type(s).__name__)
        if not s:
            return 0
        if self.other is not None and self.other._buf:
            self.other.flush()
        self._buf.append(s)
        if "\n" in s or sum(map(len, self._buf)) >= 8192:
            self.flush()
        return len(s)

    def flush(self):
        if self._buf:
            text, self._buf = "".join(self._buf), []
            if _in_run:
                send({"type": self._name, "data": text})


_stdout = _Stream("stdout", 1)
_stderr = _Stream("stderr", 2, _stdout)
_stdout.other = _stderr


def _flush_streams():
    _stdout.flush()
    _stderr.flush()


# ---- rich output ----

_REPR_METHODS = [("_repr_html_", "text/html"), ("_repr_markdown_", "text/markdown"),
                 ("_repr_svg_", "image/svg+xml"), ("_repr_png_", "image/png"), ("_repr_jpeg_", "image/jpeg"),
                 ("_repr_latex_", "text/latex"), ("_repr_json_", "application/json")]


def _mime_value(mime, value):
    if value is None:
        return None
    if isinstance(value, tuple):  # (data, metadata), as IPython allows
        value = value[0]
    if mime in ("image/png", "image/jpeg"):
        if isinstance(value, (bytes, bytearray)):
            return base64.b64encode(bytes(value)).decode("ascii")
        return str(value)  # already base64
    if mime == "application/json":
        if isinstance(value, (str, bytes)):
            value = json.loads(value)
        json.dumps(value)  # refuses what is not JSON
        return value
    return str(value)


def mimebundle(obj):
    # The forms IPython would show: the object's _repr_*_ methods (looked up on its type, so a class that
    # merely defines them is not taken for an instance), then text/plain from repr().
    data = {}
    kind = type(obj)
    formatters = []
    if getattr(kind, "_repr_mimebundle_", None) is not None:
        formatters.append(("_repr_mimebundle_", None))
    formatters += [(m, mime) for m, mime in _REPR_METHODS if getattr(kind, m, None) is not None]
    for method, mime in formatters:
        try:
            if mime is None:
                bundle = getattr(obj, method)(include=None, exclude=None)
                if isinstance(bundle, tuple):
                    bundle = bundle[0]
                for m, v in (bundle or {}).items():
                    v = _mime_value(m, v)
                    if v is not None:
                        data.setdefault(m, v)
            elif mime not in data:
                v = _mime_value(mime, getattr(obj, method)())
                if v is not None:
                    data[mime] = v
        except Exception as e:  # a broken formatter costs its form, not the run
            _stderr.write("[sandgate: %s.%s raised %s: %s]\n" % (kind.__name__, method, type(e).__name__, e))
    if "text/plain" not in data:
        try:
            data["text/plain"] = repr(obj)
        except Exception as e:
            data["text/plain"] = "<%s object: repr raised %s>" % (kind.__name__, type(e).__name__)
    return data


def display(*objs):
    """Sends each object as a display event (image/png, text/html, ... and text/plain), like IPython's."""
    for obj in objs:
        _flush_streams()
        send({"type": "display", "data": mimebundle(obj)})


def _show_figures(*args, **kwargs):
    # plt.show() and the end of a run: every open figure becomes an image/png display and is closed, as
    # Jupyter's inline backend does.
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return
    for num in pyplot.get_fignums():
        fig = pyplot.figure(num)
        buf = io.BytesIO()
        try:
            fig.savefig(buf, format="png", bbox_inches="tight")
        except Exception as e:
            _stderr.write("[sandgate: figure %s could not be drawn: %s: %s]\n" % (num, type(e).__name__, e))
            continue
        _flush_streams()
        send({"type": "display",
              "data": {"image/png": base64.b64encode(buf.getvalue()).decode("ascii"), "text/plain": repr(fig)}})
    pyplot.close("all")


class _PyplotHook(importlib.abc.MetaPathFinder):
    # matplotlib.pyplot, once the code imports it, gets a show() that sends the figures instead of the Agg
    # backend's warning that it cannot show them.
    def find_spec(self, name, path, target=None):
        if name != "matplotlib.pyplot":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real = spec.loader.exec_module

        def exec_module(module):
            real(module)
            module.show = _show_figures

        spec.loader.exec_module = exec_module
        return spec


# ---- running code ----

namespace = {"__name__": "__main__", "__builtins__": builtins, "display": display}
_cells = []


def _error_event(e, skip_frames):
    tb = e.__traceback__
    for _ in range(skip_frames):
        if tb is not None:
            tb = tb.tb_next
    lines = "".join(traceback.format_exception(type(e), e, tb)).splitlines()
    try:
        message = str(e)
    except Exception:
        message = "<str() of the exception failed>"
    return {"type": "error", "name": type(e).__name__, "message": message, "traceback": lines}


def _ends_with_semicolon(code, node):
    line = code.splitlines()[node.end_lineno - 1].encode("utf-8", "replace")
    return line[node.end_col_offset:].lstrip().startswith(b";")  # ast's columns count UTF-8 bytes


def run(code, number):
    filename = "<cell-%d>" % number
    # The source is registered so tracebacks show the lines of the cell, as in a REPL.
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    _cells.append(filename)
    while len(_cells) > KEPT_CELLS:
        linecache.cache.pop(_cells.pop(0), None)
    try:
        tree = ast.parse(code, filename, "exec")
    except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError) as e:
        send({"type": "error", "name": type(e).__name__, "message": str(e),
              "traceback": "".join(traceback.format_exception_only(type(e), e)).splitlines()})
        return
    last = None
    # A final expression is the result, as in a REPL, unless the cell ends with ';' (IPython's way to say
    # "no output", e.g. after plt.plot(...)).
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not _ends_with_semicolon(code, tree.body[-1]):
        last = ast.Expression(tree.body.pop().value)
    try:
        # compile() and the two exec/eval calls below are the frames a traceback skips: the user sees only
        # the cell's own frames.
        exec(compile(tree, filename, "exec"), namespace)
        if last is not None:
            value = eval(compile(last, filename, "eval"), namespace)
            if value is not None:
                namespace["_"] = value
                _flush_streams()
                send({"type": "result", "data": mimebundle(value)})
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: the context lives on
        _flush_streams()
        send(_error_event(e, 1))
    # Figures drawn before an exception are shown too, as in Jupyter.
    _show_figures()


# ---- bash ----
#
# A bash context is one bash process, started at the first run (and again after it exited), that keeps
# variables, functions, the working directory and exported names from cell to cell. Each cell is written to
# a file that bash sources with stdin from /dev/null, after which bash writes the cell's exit status on a
# pipe of its own (fd 5 in bash): the end of a cell is that line, never a marker in the output. bash writes
# to this process's fd 1 and 2 (the captures), so its output and its programs' keep their order. It is in
# this process's group: an interrupt reaches bash and its foreground program, and the agent's kill reaches
# all. Its trap makes an interrupt end the cell (status 130) but not bash.

STATUS_FD_IN_BASH = 5
_bash = None


class _Bash:
    def __init__(self):
        import subprocess
        import tempfile
        self.dir = tempfile.mkdtemp(prefix="sandgate-bash-")
        status_r, status_w = os.pipe()
        os.set_inheritable(status_w, True)
        # Started during a run, when SIGINT is not ignored here: a signal ignored when bash starts could
        # never be trapped there.
        self.proc = subprocess.Popen(["bash", "--noprofile", "--norc", "-s"], stdin=subprocess.PIPE, stdout=1,
                                     stderr=2, pass_fds=(status_w,), close_fds=True)
        os.close(status_w)
        self.status = os.fdopen(status_r, "rb", buffering=0)
        if status_w != STATUS_FD_IN_BASH:
            self._send("exec %d>&%d %d>&-\n" % (STATUS_FD_IN_BASH, status_w, status_w))
        self._send("trap 'return 130 2>/dev/null' INT\n")

    def _send(self, text):
        self.proc.stdin.write(text.encode("utf-8", "replace"))
        self.proc.stdin.flush()

    def run(self, code, number):
        """The cell's exit status, or None when bash exited (its status in self.proc.returncode)."""
        path = os.path.join(self.dir, "cell-%d" % number)
        with open(path, "w", encoding="utf-8", errors="replace") as f:
            f.write(code)
            if code and not code.endswith("\n"):
                f.write("\n")
        # One line, so bash reads it whole before it runs any of it.
        self._send("source %s </dev/null; printf '%%d\\n' \"$?\" >&%d; rm -f %s\n"
                   % (_shell_quote(path), STATUS_FD_IN_BASH, _shell_quote(path)))
        line = b""
        interrupted = False
        while not line.endswith(b"\n"):
            try:
                ready, _, _ = select.select([self.status], [], [], 0.2)
                if ready:
                    chunk = self.status.read(64)
                    if not chunk:
                        break
                    line += chunk
                elif self.proc.poll() is not None:
                    break
            except KeyboardInterrupt:
                # The agent's interrupt (timeout_secs): passed on to bash and what it runs, once; this process
                # ignores the copy it sends itself, and later ones until the run ends.
                if not interrupted:
                    interrupted = True
                    signal.signal(signal.SIGINT, signal.SIG_IGN)
                    os.killpg(os.getpgrp(), signal.SIGINT)
        if not line.endswith(b"\n"):
            self.proc.wait()
            return None, interrupted
        return int(line.strip() or b"1"), interrupted


def _shell_quote(text):
    return "'" + text.replace("'", "'\\''") + "'"


def run_bash(code, number):
    global _bash
    if _bash is not None and _bash.proc.poll() is not None:
        _bash = None
    if _bash is None:
        _bash = _Bash()
    try:
        status, interrupted = _bash.run(code, number)
    except BaseException:
        # An interrupt or failure before the cell's status was read (while it was being handed to bash):
        # whatever bash is doing cannot be told apart from the next cell, so this bash goes.
        _bash.proc.kill()
        _bash.proc.wait()
        _bash = None
        raise
    if status is None:
        code = _bash.proc.returncode
        _bash = None
        send({"type": "error", "name": "ShellExited",
              "message": "bash exited (%s): the next run starts a new one, without this one's variables"
                         % ("status %d" % code if code >= 0 else "signal %d" % -code),
              "traceback": []})
    elif interrupted:
        send({"type": "error", "name": "KeyboardInterrupt", "message": "interrupted (exit status %d)" % status,
              "traceback": []})
    elif status != 0:
        send({"type": "error", "name": "ExitStatus", "message": "exit status %d" % status, "traceback": []})


def _read_exact(n):
    chunks = []
    while n > 0:
        chunk = os.read(REQUESTS_FD, n)
        if not chunk:
            sys.exit(0)  # the agent closed the pipe: the context is gone
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def main():
    global _in_run
    sys.stdout, sys.stderr = _stdout, _stderr
    _capture_output()
    sys.meta_path.insert(0, _PyplotHook())
    # The agent interrupts a run with SIGINT (timeout_secs); between runs it is ignored, so a late one cannot
    # break the protocol code.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _send_raw(_encode({"type": "ready", "pid": os.getpid()}))
    number = 0
    while True:
        (size,) = struct.unpack(">I", _read_exact(4))
        request = json.loads(_read_exact(size))
        number += 1
        _in_run = True
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # A KeyboardInterrupt raised inside _send_raw's finally could have left SIGINT blocked.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        try:
            (run_bash if LANGUAGE == "bash" else run)(request["code"], number)
            _flush_streams()
        except BaseException as e:  # a KeyboardInterrupt that landed outside the cell (while formatting)
            _flush_streams()
            send(_error_event(e, 0))
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        # What the run's programs wrote last belongs to this run: out before the run is over.
        with _order_lock:
            _drain_all()
        _in_run = False
        _send_raw(_encode({"type": "done"}))


main()
