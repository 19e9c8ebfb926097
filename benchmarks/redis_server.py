"""A throwaway Redis for the queue benchmark: started on a free loopback port, stopped afterwards.

Bench-only harness (not product code): like the queue tests' broker, it runs
the Debian ``redis-server`` as its own process group in a temporary directory,
but without persistence (a benchmark needs no restart) and without the tests'
process-group bookkeeping. It never assumes a Redis is already running, and
installs the package when it is missing.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from pandastack_local.testing.procs import stop_group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _redis_server() -> str:
    """The Debian ``redis-server``, installed with apt when missing (as ``tests/queue/run.sh`` does)."""
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    if os.path.exists(exe):
        return exe
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise SystemExit("redis-server is missing: apt-get install redis-server")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], env=env, check=True, stdout=subprocess.DEVNULL)
    # Its own service does not start here (no systemd; policy-rc.d): this benchmark starts its own.
    argv = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "redis-server"]
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
    return shutil.which("redis-server") or "/usr/bin/redis-server"


class RedisServer:
    """``with RedisServer() as redis: redis.url("jobs")``."""

    def __init__(self) -> None:
        self.exe = _redis_server()
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="pandastack-bench-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        argv = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(self.dir), "--protected-mode", "yes"]
        log = open(self.dir / "redis.log", "wb")  # the child keeps its own copy
        self.proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + 30
        while not _listening(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise SystemExit(f"redis-server did not start on port {self.port}:\n{tail}")
            time.sleep(0.05)
        return self

    def url(self, stream: str) -> str:
        return f"redis://127.0.0.1:{self.port}/0?stream={stream}&group=bench"

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, 10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
