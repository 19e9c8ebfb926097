"""The warm runner: an interpreter that has already imported the engine's modules, waiting for ONE job.

Runs inside a standby sandbox (stdlib only, Python >= 3.9; it must never import pandastack_jobs).
It imports the modules named on its command line (``--optional NAME``: imported if it can be,
skipped and reported in the state if not), binds ``runner.sock`` (mode 0600) in its
directory, writes the ready state, and blocks in ``accept()`` (no CPU while idle) for at most
``--idle`` seconds. Its one client is ``warm_attach.py``, run as the job's command: it sends the
cold argv, its environment and cwd (JSON, length-prefixed, bounded) and its fds 0, 1, 2. The runner
forks a child that takes those fds, that environment and cwd, and runs the module the way
``python -m`` would; the runner waits for the child and sends back its exit status. If the attach
goes away first (the guest-side timeout killed it), the child's process group is SIGKILLed.
Anything the runner cannot run warm (another interpreter, a ``PYTHON*`` variable that differs from
the one the modules were imported under, a fork that fails) is answered ``cold``: the attach then
runs the cold argv itself, in the same sandbox.
"""

import json
import os
import select
import shutil
import signal
import socket
import struct
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
SOCK = os.path.join(HERE, "runner.sock")
STATE = os.path.join(HERE, "state")
PIDFILE = os.path.join(HERE, "runner.pid")
MAGIC = b"PSW1"
HEADER = struct.Struct("!4sI")  # magic, payload length
MAX_REQUEST_BYTES = 1024 * 1024  # argv + environ: the kernel's own ARG_MAX is in this range
MAX_ERROR_CHARS = 4000
REQUEST_SECONDS = 10.0  # the request must arrive this soon after connect
PROTOCOL_FDS = 3
# Start-up choices the fork inherits and cannot change: they must match for the job to run warm.
_STARTUP_ONLY = "PYTHON"


def _write_state(state):
    tmp = STATE + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(state, fh)
    os.replace(tmp, STATE)


def _parse_args(argv):
    idle = 3600.0
    modules = []
    optional = []
    i = 0
    while i < len(argv):
        if argv[i] == "--idle":
            idle = float(argv[i + 1])
            i += 2
            continue
        if argv[i] == "--optional":
            optional.append(argv[i + 1])
            i += 2
            continue
        modules.append(argv[i])
        i += 1
    return idle, modules, optional


def _preload(modules, optional=()):
    """Import ``modules`` (a failure fails the standby), then ``optional`` ones: a module this
    environment lacks (another engine version, say) is only skipped; the job imports what it needs."""
    started = time.monotonic()
    for name in modules:
        __import__(name)
    skipped = []
    for name in optional:
        try:
            __import__(name)
        except ImportError as exc:
            skipped.append(f"{name}: {type(exc).__name__}: {exc}"[:200])
    return time.monotonic() - started, skipped


def _recv_exact(conn, n):
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("attach closed the connection mid-request")
        data += chunk
    return data


def _close_fds(fds):
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _receive(conn):
    """The request and its three fds; anything malformed raises ValueError (fds closed)."""
    conn.settimeout(REQUEST_SECONDS)
    # One byte more room than the protocol's fds, so extras are seen (and closed), not truncated away.
    msg, fds, flags, _addr = socket.recv_fds(conn, HEADER.size, PROTOCOL_FDS + 1)
    if len(fds) != PROTOCOL_FDS or flags & getattr(socket, "MSG_CTRUNC", 0):
        _close_fds(fds)
        raise ValueError(f"expected exactly {PROTOCOL_FDS} fds, got {len(fds)}")
    try:
        if len(msg) < HEADER.size:
            msg += _recv_exact(conn, HEADER.size - len(msg))
        magic, length = HEADER.unpack(msg)
        if magic != MAGIC or length > MAX_REQUEST_BYTES:
            raise ValueError("bad header or request too large")
        req = json.loads(_recv_exact(conn, length).decode("utf-8"))
        argv, env, cwd = req.get("argv"), req.get("env"), req.get("cwd")
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
            raise ValueError("argv must be a non-empty list of strings")
        pairs = env.items() if isinstance(env, dict) else ()
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in pairs):
            raise ValueError("env must map strings to strings")
        if not isinstance(cwd, str):
            raise ValueError("cwd must be a string")
    except Exception:
        _close_fds(fds)
        raise
    return argv, env, cwd, fds


def _plan(argv, env):
    """How the child runs argv: ("module"|"path", target, args, unbuffered), or a reason to go cold."""
    exe = shutil.which(argv[0], path=env.get("PATH")) if "/" not in argv[0] else argv[0]
    if not exe or os.path.realpath(exe) != os.path.realpath(sys.executable):
        return f"{argv[0]} is not this runner's interpreter ({sys.executable})"
    for name in set(env) | set(os.environ):
        if name.startswith(_STARTUP_ONLY) and env.get(name) != os.environ.get(name):
            return f"{name} differs from the one the modules were imported under"
    rest = argv[1:]
    unbuffered = False
    while rest and rest[0] == "-u":
        unbuffered = True
        rest = rest[1:]
    if len(rest) >= 2 and rest[0] == "-m" and rest[1]:
        return ("module", rest[1], rest[2:], unbuffered)
    if rest and not rest[0].startswith("-"):
        return ("path", rest[0], rest[1:], unbuffered)
    return f"cannot run {argv[1:3]!r} warm (only python [-u] -m MODULE ... or python [-u] FILE ...)"


def _send(conn, message):
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass


def _reopen_stdio(unbuffered):
    """New sys.std* on fds 0, 1, 2 (now the attach's), buffered as a fresh interpreter would."""
    import io

    unbuffered = unbuffered or bool(os.environ.get("PYTHONUNBUFFERED"))
    streams = []
    for fd, mode in ((0, "rb"), (1, "wb"), (2, "wb")):
        old = (sys.stdin, sys.stdout, sys.stderr)[fd]
        encoding = getattr(old, "encoding", None) or "utf-8"
        errors = getattr(old, "errors", None) or ("backslashreplace" if fd == 2 else "strict")
        raw = io.FileIO(fd, mode, closefd=False)
        interactive = raw.isatty()
        buf = raw  # type: io.RawIOBase | io.BufferedIOBase
        if fd == 0:
            buf = io.BufferedReader(raw)
        elif not unbuffered:
            buf = io.BufferedWriter(raw)
        stream = io.TextIOWrapper(  # type: ignore[type-var]
            buf,
            encoding=encoding,
            errors=errors,
            line_buffering=fd == 2 or (fd == 1 and interactive),
            write_through=unbuffered and fd != 0,
        )
        streams.append(stream)
    sys.stdin, sys.stdout, sys.stderr = streams


def _child(plan, env, cwd, fds, conn, listener):
    """In the fork: become the job. Returns only by raising SystemExit (the interpreter's own exit)."""
    import runpy
    import warnings

    os.setpgid(0, 0)  # the job's own process group: killed whole when its attach goes away
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    _close_fds([fd for fd in fds if fd > 2])
    conn.close()
    if listener is not None:
        listener.close()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(env)
    os.environ["PANDASTACK_WARM"] = "1"
    kind, target, args, unbuffered = plan
    _reopen_stdio(unbuffered)
    try:
        os.chdir(cwd)
    except OSError as exc:
        print(f"warm runner: cannot enter {cwd}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    if kind == "module":
        sys.path[0] = os.getcwd()
        sys.argv = [target, *args]
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        sys.argv = [target, *args]
    if kind == "module":
        # The runner preloaded the module, so runpy warns that it is already in sys.modules: that
        # is the point of a standby, not the job's problem (the job still runs a fresh __main__).
        warnings.filterwarnings(
            "ignore", message=r".*found in sys\.modules after import of package", category=RuntimeWarning
        )
    try:
        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - reported as the interpreter would
        # As the interpreter prints it, without the runner's own frames.
        tb = exc.__traceback__
        while tb is not None and _runner_frame(tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        raise SystemExit(130 if isinstance(exc, KeyboardInterrupt) else 1) from None
    raise SystemExit(0)


def _runner_frame(filename):
    return filename == __file__ or "runpy" in os.path.basename(filename)


def _exit_code(status):
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _wait(conn, pid):
    """The child's exit code; SIGKILL its process group first if the attach hangs up."""
    conn.setblocking(True)
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            pidfd = None
    watch = [conn] + ([pidfd] if pidfd is not None else [])
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return _exit_code(status)
            ready, _, _ = select.select(watch, [], [], 0.05 if pidfd is None else None)
            if conn in ready:
                try:
                    gone = conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except OSError:
                        pass
                    os.waitpid(pid, 0)
                    return None
                conn.recv(4096)  # the attach sends nothing more: drop it
    finally:
        if pidfd is not None:
            os.close(pidfd)


def serve(listener, idle):
    """Accept one attach within ``idle`` seconds and run its job; the runner's exit code."""
    listener.settimeout(idle)
    try:
        conn, _ = listener.accept()
    except TimeoutError:
        return 0
    finally:
        try:
            os.unlink(SOCK)  # one job per standby: nobody else may connect
        except OSError:
            pass
    try:
        argv, env, cwd, fds = _receive(conn)
    except (ValueError, OSError) as exc:
        _send(conn, {"error": str(exc)[:MAX_ERROR_CHARS]})
        return 2
    plan = _plan(argv, env)
    if isinstance(plan, str):
        _close_fds(fds)
        _send(conn, {"cold": plan})
        return 0
    try:
        pid = os.fork()
    except OSError as exc:
        _close_fds(fds)
        _send(conn, {"cold": f"fork failed: {exc}"})
        return 0
    if pid == 0:
        _child(plan, env, cwd, fds, conn, listener)  # raises SystemExit, never returns
    _close_fds(fds)
    listener.close()
    _send(conn, {"started": pid})
    code = _wait(conn, pid)
    if code is not None:
        _send(conn, {"exit": code})
    conn.close()
    return 0


def main(argv):
    idle, modules, optional = _parse_args(argv)
    try:
        preload, skipped = _preload(modules, optional)
    except BaseException as exc:  # noqa: BLE001 - any import failure is reported, never hidden
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        _write_state({"ready": False, "error": f"preload failed: {text}"[:MAX_ERROR_CHARS]})
        return 3
    old = os.umask(0o077)
    try:
        try:
            os.unlink(SOCK)
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(SOCK)
    finally:
        os.umask(old)
    os.chmod(SOCK, 0o600)
    listener.listen(1)
    with open(PIDFILE, "w") as fh:
        fh.write(f"{os.getpid()}\n")
    _write_state(
        {
            "ready": True,
            "pid": os.getpid(),
            "preload_seconds": round(preload, 6),
            "python": sys.version.split()[0],
            "modules": modules,
            "optional": optional,
            "skipped": skipped,
        }
    )
    return serve(listener, idle)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
