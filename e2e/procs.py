"""Process management for the e2e topology: start, log, wait, stop — every wait bounded.

Every process runs in its own session (process group), its output goes to a log
file under the run directory, and its process group id is appended to
``<run_dir>/pgids`` so that ``e2e/run.sh`` can kill whatever is left even if
pytest itself dies. Nothing here listens anywhere but 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pandastack_local.testing.procs import descendants

_used_ports: set[int] = set()


def free_port() -> int:
    """A loopback TCP port nobody listens on now (and that this run has not handed out)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _used_ports:
            _used_ports.add(port)
            run_dir = os.environ.get("E2E_RUN_DIR")
            if run_dir:  # run.sh checks that none of these is still listening at the end
                with open(os.path.join(run_dir, "ports"), "a") as f:
                    f.write(f"{port}\n")
            return port
    raise RuntimeError("no free loopback port")


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


@dataclass
class Proc:
    name: str
    argv: Sequence[str]
    popen: subprocess.Popen[bytes]
    log_path: Path
    stop_signal: int = signal.SIGTERM
    ports: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 80) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def kill_tree(self) -> None:
        """The machine dies: every descendant (those that left the group too) and the group at
        once. All are stopped (SIGSTOP, the root first) before any is killed, so no survivor sees
        another die: a worker killed a moment after its flow-run process would report that run
        crashed (CI under load saw it), which a dead machine never does."""
        tree = [self.pid, *descendants(self.pid)]
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        self.kill_group(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def stop(self, grace: float = 15.0) -> None:
        """Stop the process and everything in its group: the stop signal, then SIGKILL."""
        if self.alive():
            self.kill_group(self.stop_signal)
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        # Children left in the group (pool processes, task runners) go too.
        self.kill_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)


class ProcessGroup:
    """Every process the e2e run started, stopped in reverse order by :meth:`stop_all`."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.log_dir = run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        stop_signal: int = signal.SIGTERM,
        user: str | None = None,
        ports: Sequence[int] = (),
    ) -> Proc:
        log_path = self.log_dir / f"{name}.log"
        log = open(log_path, "ab")
        log.write(f"$ {' '.join(argv)}\n".encode())
        log.flush()
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=str(cwd) if cwd else None,
            start_new_session=True,
            user=user,
        )
        log.close()
        with open(self.run_dir / "pgids", "a") as f:
            f.write(f"{popen.pid} {name}\n")
        proc = Proc(name, argv, popen, log_path, stop_signal, list(ports))
        self.procs.append(proc)
        return proc

    def get(self, name: str) -> Proc:
        for p in self.procs:
            if p.name == name:
                return p
        raise KeyError(name)

    def stop(self, name: str) -> None:
        self.get(name).stop()

    @contextlib.contextmanager
    def stopping(self, prefix: str) -> Iterator[None]:
        """On leaving the block, stop every process whose name starts with ``prefix``."""
        try:
            yield
        finally:
            for proc in [p for p in self.procs if p.name.startswith(prefix)]:
                proc.stop()

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(Exception):
                proc.stop()

    def dump_logs(self, lines: int = 60) -> str:
        out = []
        for proc in self.procs:
            state = "running" if proc.alive() else f"exited {proc.popen.returncode}"
            out.append(f"===== {proc.name} (pid {proc.pid}, {state}) — {proc.log_path} =====")
            out.append(proc.tail(lines))
        return "\n".join(out)


def run(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float = 300,
    log: Path | None = None,
    user: str | None = None,
) -> str:
    """Run a command to completion (bounded); raise with its output if it fails."""
    try:
        cp = subprocess.run(
            list(argv),
            env=dict(env) if env is not None else None,
            cwd=str(cwd) if cwd else None,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            user=user,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{' '.join(argv)} took longer than {timeout}s") from exc
    text = cp.stdout.decode(errors="replace") + cp.stderr.decode(errors="replace")
    if log is not None:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(argv)}\n{text}\n[exit {cp.returncode}]\n")
    if cp.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {cp.returncode}:\n{text[-4000:]}")
    return text
