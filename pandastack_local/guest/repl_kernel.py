"""A code context's Python session: one long-lived process per context, inside the sandbox.

The agent starts it (``python3 -u /.pandastack/repl_kernel.py CAPS REQ_FD REPLY_FD``: the
template's python, as the sandbox's user) with a pipe for requests and one for replies; the
server never talks to it
directly. Stdlib only (it runs with whatever the template has), imports nothing from
``pandastack_local``.

One request line ``{"code", "timeout_ms"}`` → one reply line of JSON: ``stdout``, ``stderr``
(captured at the file-descriptor level, so a subprocess's output is caught too), ``exit``,
``results`` (the last expression's text/HTML repr, and one ``image/png`` per figure that
``plt.show()`` showed), ``error`` (the formatted traceback) and ``exception`` (name, value,
traceback), or ``timeout``. Every part is capped here by the numbers the server sends (CAPS);
the server checks them again, since code in the session can write to the reply pipe itself.
"""

from __future__ import annotations

import ast
import base64
import builtins
import io
import json
import os
import signal
import sys
import tempfile
import traceback
import types
from typing import Any

BACKEND = "pandastack_repl_backend"


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


def on_alarm(signum: int, frame: Any) -> None:
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
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout)
            try:
                reply = run(str(request.get("code", "")), namespace, cell)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
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


def main() -> None:
    caps = {k: int(v) for k, v in json.loads(sys.argv[1]).items()}
    try:
        with open("/proc/self/oom_score_adj", "w") as f:  # first in line for the OOM killer, as execs
            f.write("1000")
    except OSError:
        pass
    install_backend()
    signal.signal(signal.SIGALRM, on_alarm)
    user_main = types.ModuleType("__main__")
    user_main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = user_main  # the session's globals (pickling a class defined in a cell)
    requests = os.fdopen(int(sys.argv[2]), "rb")
    replies = os.fdopen(int(sys.argv[3]), "wb")
    replies.write(b'{"ready": true}\n')
    replies.flush()
    for line in requests:
        reply = cell_reply(json.loads(line), user_main.__dict__, caps)
        replies.write(json.dumps(reply).encode() + b"\n")
        replies.flush()


if __name__ == "__main__":
    main()
