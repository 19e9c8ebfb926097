"""The one ``/proc`` walker of the tests, e2e and benchmarks (Linux only; no psutil in either venv).

The process tree comes from the server's own walker (``pandastack_local.isolation``), which
kills a sandbox's host processes with it; everything else a test asks of ``/proc`` is here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pandastack_local.isolation.process import host_descendants as descendants

__all__ = [
    "descendants",
    "listening_ports",
    "own_sleep",
    "pids",
    "pids_matching",
    "read_proc",
    "rss_and_fds",
    "rss_kb",
    "starttime",
    "stop_group",
    "tree_rss_kb",
]


def stop_group(proc: subprocess.Popen[Any], grace: float) -> None:
    """SIGTERM the process group ``proc`` leads (it was started with ``start_new_session=True``),
    and SIGKILL it when ``proc`` has not exited ``grace`` seconds later; nothing if it has exited."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def pids() -> Iterator[int]:
    """Every process on the host but this one (processes may exit while the caller reads them)."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            yield int(entry)


def read_proc(pid: int, name: str) -> bytes | None:
    """``/proc/<pid>/<name>`` (``cmdline``, ``environ``, ``stat``...), or None if it is gone."""
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return None


def own_sleep(tag: int) -> str:
    """A ``sleep`` command line no other test process on this host runs, for a test to look for
    on the host: CI's legs run the same tests side by side (``test-server`` beside
    ``test-nonroot``), and a fixed one would find, or count, the other leg's. ``tag`` (two digits)
    tells one test's apart; every such line has the same length, so none is a prefix of another."""
    if not 10 <= tag <= 99:
        raise ValueError(f"own_sleep: tag {tag} is not two digits")
    return f"sleep {tag}{os.getpid():07d}"


def pids_matching(text: str) -> list[int]:
    """Host processes (not this one) whose command line contains ``text``."""
    needle = text.encode()
    return [pid for pid in pids() if needle in (read_proc(pid, "cmdline") or b"").replace(b"\0", b" ")]


def starttime(pid: int) -> str | None:
    """The process's start time in clock ticks: with the pid, it names one process for good."""
    data = read_proc(pid, "stat")
    return None if data is None else data[data.rfind(b")") + 2 :].split()[19].decode()


def rss_kb(pid: int | None = None, field: str = "VmRSS") -> int:
    """Resident set size of one process (default: this one), in kB (``field="VmHWM"``: its peak)."""
    for line in Path(f"/proc/{pid or 'self'}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def tree_rss_kb(pid: int) -> int:
    """RSS of a process and all its descendants (summed; shared pages counted twice)."""
    total = 0
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(OSError):
            total += rss_kb(p)
    return total


def rss_and_fds() -> tuple[int, int]:
    """(RSS in kB, open fds) of this process: the orchestrator, in the reliability suite."""
    return rss_kb(), len(os.listdir("/proc/self/fd"))


def fd_targets() -> list[str]:
    """What this process's open descriptors point at (sockets, pipes, files), for a leak report."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sorted(out)


def listening_ports() -> set[int]:
    """TCP ports in LISTEN state on this machine (from /proc/net/tcp{,6})."""
    ports: set[int] = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(path) as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if len(parts) > 3 and parts[3] == "0A":
                    ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports
