"""A code context's Python session: one long-lived process per context, inside the sandbox.

The agent starts it (``python3 -u /.pandastack/repl_kernel.py CAPS FD``: the
template's python, as the sandbox's user, in a Landlock domain of its own where the kernel has
Landlock) with one end of a socket pair for requests and replies (a socket, unlike a pipe,
cannot be opened again through ``/proc/<pid>/fd``); the server never talks to it directly.
Stdlib only (it runs with whatever the template has), imports nothing from ``pandastack_local``.

The process the agent starts first makes itself non-dumpable (no other process of the sandbox
can open its ``/proc/<pid>/mem`` or ``fd``) and a child subreaper, then forks: the parent stays
the context's *supervisor* (it reaps every orphan of the context, and when the kernel exits it
kills what is left and exits with the kernel's status), the child is the kernel proper, in a
nested Landlock domain that cannot signal outside itself (so code in it can neither kill its
supervisor nor stop the agent). So everything the context starts stays below the supervisor,
whatever it does to its session, and the agent's ``close()`` kills it all.

The first request line is ``{"hello": TOKEN}``, answered ``{"token": TOKEN, "ready": true,
"pid": KERNEL}``. Then one request line ``{"code", "timeout_ms", "token"}`` → one reply line of
JSON, ``token`` first (the agent takes no line without it): ``stdout``, ``stderr``
(captured at the file-descriptor level, so a subprocess's output is caught too), ``exit``,
``results`` (the last expression's text/HTML repr, and one ``image/png`` per figure that
``plt.show()`` showed), ``error`` (the formatted traceback) and ``exception`` (name, value,
traceback), or ``timeout``. Every part is capped here by the numbers the server sends (CAPS);
the server checks them again, since code in the session can write to its channel itself.
"""

from __future__ import annotations

import ctypes
import os

PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 4, 36, 38
_libc = ctypes.CDLL(None, use_errno=True)
# First of all, before anything reads a request: no other process of the sandbox (another
# context's code) may read or write this one's memory or descriptors through /proc.
_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)

import ast  # noqa: E402  (after the prctl on purpose)
import base64  # noqa: E402
import builtins  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
import types  # noqa: E402
from typing import Any  # noqa: E402

BACKEND = "pandastack_repl_backend"
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_RESTRICT_SELF = 444, 446
LANDLOCK_ACCESS_FS_MAKE_BLOCK, LANDLOCK_SCOPE_SIGNAL = 1 << 11, 1 << 1


class CellTimeout(BaseException):
    """Raised in the running cell when its timeout passes (BaseException: ``except Exception``
    in user code does not swallow it)."""


class Cell:
    """What one cell produced, capped."""

    def __init__(self, caps: dict[str, int]) -> None:
        self.caps = caps
        self.results: list[dict[str, str]] = []
        self.dropped_figures = 0

    def add_png(self, data: bytes) -> None:
        if len(self.results) >= self.caps["max_results"] or len(data) > self.caps["max_png_bytes"]:
            self.dropped_figures += 1
            return
        self.results.append({"type": "image/png", "data": base64.b64encode(data).decode()})

    def add_value(self, value: Any) -> None:
        limit = self.caps["max_text_result_bytes"]
        bundle = {"text/plain": repr(value)[:limit]}
        html = getattr(value, "_repr_html_", None)
        if callable(html) and not isinstance(value, type):
            try:
                text = html()
            except Exception:  # noqa: BLE001  a broken repr must not fail the cell
                text = None
            if isinstance(text, str):
                bundle["text/html"] = text[:limit]
        if len(self.results) < self.caps["max_results"]:
            self.results.append(bundle)


CURRENT: Cell | None = None


def show(*args: Any, **kwargs: Any) -> None:
    """``plt.show()`` in a session: every open figure becomes a PNG result and is closed."""
    from matplotlib import pyplot as plt
    from matplotlib._pylab_helpers import Gcf

    for manager in Gcf.get_all_fig_managers():
        buf = io.BytesIO()
        manager.canvas.figure.savefig(buf, format="png", bbox_inches="tight")
        if CURRENT is not None:
            CURRENT.add_png(buf.getvalue())
    plt.close("all")


def backend_attr(name: str) -> Any:
    """The backend's canvas and manager are Agg's, imported when matplotlib first asks (and then
    set on the module: pyplot copies the module's ``vars()``)."""
    from matplotlib.backend_bases import FigureManagerBase
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    module = sys.modules[BACKEND]
    module.FigureCanvas = FigureCanvasAgg  # type: ignore[attr-defined]
    module.FigureManager = FigureManagerBase  # type: ignore[attr-defined]
    if name not in ("FigureCanvas", "FigureManager"):
        raise AttributeError(name)
    return getattr(module, name)


def install_backend() -> None:
    """A matplotlib backend (``module://pandastack_repl_backend``): Agg, with our ``show``."""
    module = types.ModuleType(BACKEND)
    module.show = show  # type: ignore[attr-defined]
    module.__getattr__ = backend_attr  # type: ignore[method-assign]
    sys.modules[BACKEND] = module
    os.environ["MPLBACKEND"] = f"module://{BACKEND}"


RUNNING = False  # a cell is running: the alarm (its timeout, or the agent's interrupt) stops it


def on_alarm(signum: int, frame: Any) -> None:
    if RUNNING:
        raise CellTimeout


def read_capped(f: Any, cap: int, name: str) -> str:
    """The first ``cap`` bytes of a captured stream, and a line saying how much was dropped."""
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    text = f.read(cap).decode("utf-8", "replace")
    if size > cap:
        text += (
            f"\n[pandastack-local: {size - cap} more bytes of {name} dropped: a code context keeps "
            f"the first {cap} bytes of each stream per run]\n"
        )
    return text


def run(code: str, namespace: dict[str, Any], cell: Cell) -> dict[str, Any]:
    reply: dict[str, Any] = {"exit": 0}
    try:
        tree = ast.parse(code, "<cell>", "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body[-1].value)
            tree.body.pop()
        exec(compile(tree, "<cell>", "exec"), namespace)  # noqa: S102  running the user's cell is the job
        if last is not None:
            value = eval(compile(last, "<cell>", "eval"), namespace)  # noqa: S307  the cell's last expression
            if value is not None:
                print(repr(value))  # as the real server's kernel does
                cell.add_value(value)
    except CellTimeout:
        reply["timeout"] = True
        reply["exit"] = 1
    except SystemExit as exc:
        reply["exit"] = exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:  # noqa: BLE001  the cell's error is the reply, not the kernel's
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next  # the kernel's own frames are not the user's traceback
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        sys.stderr.write(text)
        reply.update(
            exit=1,
            error=text,
            exception={"name": type(exc).__name__, "value": str(exc), "traceback": text},
        )
    return reply


def cell_reply(request: dict[str, Any], namespace: dict[str, Any], caps: dict[str, int]) -> dict[str, Any]:
    """Run one cell with fds 1 and 2 sent to temporary files, under its timeout."""
    global CURRENT
    cell = CURRENT = Cell(caps)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        timeout = max(int(request.get("timeout_ms") or 0), 1) / 1000
        global RUNNING
        try:
            RUNNING = True
            signal.setitimer(signal.ITIMER_REAL, timeout)
            try:
                reply = run(str(request.get("code", "")), namespace, cell)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                RUNNING = False
        except CellTimeout:  # the alarm fired after the cell ended, before it was disarmed
            reply = {"exit": 0}
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        if cell.dropped_figures:
            err.write(
                f"[pandastack-local: {cell.dropped_figures} figure(s) not returned: at most "
                f"{caps['max_results']} results of at most {caps['max_png_bytes']} bytes each]\n".encode()
            )
        reply["stdout"] = read_capped(out, caps["max_output_bytes"], "stdout")
        reply["stderr"] = read_capped(err, caps["max_output_bytes"], "stderr")
    reply["results"] = cell.results
    CURRENT = None
    return reply


def nested_domain() -> None:
    """Enter a Landlock domain below the one the agent gave the context, scoped for signals: code
    here cannot signal the supervisor, the agent or other contexts. Nothing where the kernel has
    no Landlock (gVisor), or no signal scoping (before Linux 6.12)."""
    abi = _libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 6:
        return
    attr = (ctypes.c_uint64 * 3)(LANDLOCK_ACCESS_FS_MAKE_BLOCK, 0, LANDLOCK_SCOPE_SIGNAL)
    fd = _libc.syscall(
        SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(24), ctypes.c_uint32(0)
    )
    if fd < 0:
        return
    try:
        if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0:
            _libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, fd, 0)
    finally:
        os.close(fd)


def kill_all_below(root: int) -> None:
    """SIGKILL every process below ``root`` (the supervisor: everything the context started)."""
    for _ in range(100):
        children: dict[int, list[int]] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    data = f.read()
            except OSError:
                continue
            children.setdefault(int(data[data.rfind(b")") + 2 :].split()[1]), []).append(int(name))
        below, todo = [], [root]
        while todo:
            for child in children.get(todo.pop(), []):
                below.append(child)
                todo.append(child)
        if not below:
            return
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass


def supervise(kernel: int) -> None:
    """The supervisor's life: reap every child (the kernel, and each orphan of the context that
    the kernel's being a subreaper's child brings here); when the kernel exits, kill and reap what
    is left and exit as the kernel did."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(1)
        except InterruptedError:
            continue
        if pid != kernel:
            continue
        kill_all_below(os.getpid())
        if os.WIFSIGNALED(status):  # die of the same signal, so the agent reports the same code
            sig = os.WTERMSIG(status)
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):  # SIGKILL keeps its default anyway
                pass
            os.kill(os.getpid(), sig)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def main() -> None:
    caps = {k: int(v) for k, v in json.loads(sys.argv[1]).items()}
    fd = int(sys.argv[2])
    os.set_inheritable(fd, False)  # the kernel's alone: a subprocess of the cell does not inherit it
    try:
        with open("/proc/self/oom_score_adj", "w") as f:  # first in line for the OOM killer, as execs
            f.write("1000")
    except OSError:
        pass
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    kernel = os.fork()
    if kernel:
        os.close(fd)  # the agent sees EOF on the replies the moment the kernel is gone
        supervise(kernel)
    nested_domain()
    install_backend()
    signal.signal(signal.SIGALRM, on_alarm)
    user_main = types.ModuleType("__main__")
    user_main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = user_main  # the session's globals (pickling a class defined in a cell)
    chan = socket.socket(fileno=fd)
    requests = chan.makefile("rb")
    replies = chan.makefile("wb")
    for line in requests:
        request = json.loads(line)
        if "hello" in request:
            reply: dict[str, Any] = {"ready": True, "pid": os.getpid()}
            token = str(request["hello"])
        else:
            token = str(request.get("token", ""))
            reply = cell_reply(request, user_main.__dict__, caps)
        replies.write(json.dumps({"token": token, **reply}).encode() + b"\n")
        replies.flush()


if __name__ == "__main__":
    main()
