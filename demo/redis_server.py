"""A throwaway Redis for the demo's queue part: installed with apt if missing, started on a free
loopback port in a temporary directory, always stopped afterwards.

The server runs in its own session (a Ctrl-C in the terminal reaches only the demo, whose
``finally`` stops it) with a parent-death signal, so even a SIGKILLed demo leaves no Redis behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def ensure_redis_server(say: object = print) -> str:
    """The path of ``redis-server``; installs Debian's ``redis-server`` package when it is missing."""
    found = shutil.which("redis-server")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise RuntimeError("redis-server is not installed: apt-get install redis-server (as root)")
    if callable(say):
        say("  installing redis-server (apt) ...")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "redis-server"],
    ):
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError("apt-get installed redis-server but it is not on PATH")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _answers(port: int, password: str) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(f"AUTH {password}\r\nPING\r\n".encode())
            reply = b""
            while b"PONG" not in reply and b"-" not in reply and len(reply) < 256:
                chunk = s.recv(64)
                if not chunk:
                    break
                reply += chunk
            return reply.startswith(b"+OK") and b"+PONG" in reply
    except OSError:
        return False


@contextlib.contextmanager
def redis_server(log: Path, exe: str | None = None, tmp: Path | None = None) -> Iterator[str]:
    """A running Redis for the duration of the block; yields its URL
    (``redis://:PASSWORD@127.0.0.1:PORT/0``). Its working directory is a new temporary directory
    (under ``tmp``, else the system's); its password, random, is in a 0600 file there, never on a
    command line, so another local user can neither read nor use the demo's queue."""
    exe = exe or ensure_redis_server()
    workdir = Path(tempfile.mkdtemp(prefix="pandastack-demo-redis-", dir=tmp))
    password = secrets.token_hex(16)
    conf = workdir / "redis.conf"
    conf.touch(mode=0o600)
    conf.write_text(f"requirepass {password}\n")
    proc: subprocess.Popen[bytes] | None = None
    try:
        for _attempt in range(3):  # a free port can be taken between the probe and Redis's bind
            port = _free_port()
            argv = [exe, str(conf), "--port", str(port), "--bind", "127.0.0.1", "--protected-mode", "yes"]
            argv += ["--save", "", "--appendonly", "no", "--dir", str(workdir)]
            with log.open("ab") as out:
                proc = subprocess.Popen(
                    argv,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,  # prctl only: safe between fork and exec
                )
            deadline = time.monotonic() + 20
            while proc.poll() is None and time.monotonic() < deadline and not _answers(port, password):
                time.sleep(0.05)
            if proc.poll() is None and _answers(port, password):
                yield f"redis://:{password}@127.0.0.1:{port}/0"
                return
            _stop(proc)
            proc = None
        raise RuntimeError(f"redis-server did not start; see {log}")
    finally:
        if proc is not None:
            _stop(proc)
        shutil.rmtree(workdir, ignore_errors=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
