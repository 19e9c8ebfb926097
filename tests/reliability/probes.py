"""Host-side probes of the reliability suite: what a sandbox left on the host, a fake
orchestrator listener, secret checks, and bounded waits.

Engine-neutral: imported by the core, Airflow and Prefect files alike.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pandastack_jobs import JobOutcome
from pandastack_local.testing.procs import pids_matching, starttime


class FakeListener:
    """A TCP listener on all interfaces standing in for an orchestrator API (Airflow, Prefect).

    ``accepted()`` says whether anything connected: a sandbox that reached it is a breach.
    """

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(16)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]

    def accepted(self) -> int:
        n = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return n
            conn.close()
            n += 1

    def close(self) -> None:
        self.sock.close()


def host_ip() -> str | None:
    """A non-loopback address of this host, if it has one."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks a route
        ip = s.getsockname()[0]
        if not ip.startswith("127."):
            return str(ip)
    return None


@dataclass
class SandboxTrace:
    """What the host saw of one sandbox while it lived: its bwrap process and identity."""

    sandbox_id: str
    bwrap_pid: int | None = None
    bwrap_start: str | None = None


class HostProbe:
    """Looks at the host for anything a sandbox of ``server`` left behind."""

    def __init__(self, server: Any) -> None:
        self.server = server
        instance = hashlib.sha256(str(Path(server.state_dir).resolve()).encode()).hexdigest()[:12]
        self.base_name = f"pandastack-local-{instance}"
        self.cgroup_bases = self._cgroup_bases()
        self.lock = threading.Lock()

    def _cgroup_bases(self) -> list[Path]:
        bases = []
        try:
            lines = Path(f"/proc/{self.server.pid}/cgroup").read_text().splitlines()
        except OSError:
            return []
        for line in lines:
            _, ctrls, path = line.split(":", 2)
            names = ctrls.split(",") if ctrls else [""]
            for name in names:
                root = Path("/sys/fs/cgroup") / name.removeprefix("name=") if name else Path("/sys/fs/cgroup")
                candidate = Path(str(root) + path.rstrip("/")) / self.base_name
                if candidate.is_dir():
                    bases.append(candidate)
        return sorted(set(bases))

    def trace(self, sandbox_id: str) -> SandboxTrace:
        """Record the sandbox's bwrap process (call while it is alive, e.g. from ``on_created``)."""
        trace = SandboxTrace(sandbox_id)
        record = Path(self.server.state_dir) / "sandboxes" / sandbox_id / "record.json"
        with contextlib.suppress(OSError, ValueError, KeyError):
            trace.bwrap_pid = int(json.loads(record.read_text())["pid"])
            trace.bwrap_start = starttime(trace.bwrap_pid)
        return trace

    def alive(self, trace: SandboxTrace) -> bool:
        return trace.bwrap_pid is not None and starttime(trace.bwrap_pid) == trace.bwrap_start

    def leftovers(self, trace: SandboxTrace, markers: tuple[str, ...] = ()) -> list[str]:
        """Everything of the sandbox still on the host: processes, cgroups, its dir, mounts."""
        sid = trace.sandbox_id
        problems = []
        if self.alive(trace):
            problems.append(f"bwrap process {trace.bwrap_pid} still running")
        if (Path(self.server.state_dir) / "sandboxes" / sid).exists():
            problems.append("host dir still exists")
        for base in self.cgroup_bases:
            if (base / sid).exists():
                problems.append(f"cgroup {base / sid} still exists")
        if pids_matching(sid):
            problems.append(f"host processes naming it: {pids_matching(sid)}")
        for marker in markers:
            if pids_matching(marker):
                problems.append(f"host processes matching {marker!r}: {pids_matching(marker)}")
        with open("/proc/self/mountinfo") as f:
            if sid in f.read():
                problems.append("a mount names it")
        return problems

    def wait_clean(
        self, trace: SandboxTrace, markers: tuple[str, ...] = (), timeout: float = 15
    ) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            problems = self.leftovers(trace, markers)
            if not problems or time.monotonic() > deadline:
                return problems
            time.sleep(0.1)


class Recorder:
    """``on_created`` for the core: remembers a trace of every sandbox a job made."""

    def __init__(self, host: HostProbe) -> None:
        self.host = host
        self.traces: list[SandboxTrace] = []
        self.lock = threading.Lock()

    def __call__(self, sandbox_id: str) -> None:
        trace = self.host.trace(sandbox_id)
        with self.lock:
            self.traces.append(trace)


def secret_free(text: str, *secrets: str) -> list[str]:
    """The secrets that appear in ``text`` (empty when clean)."""
    return [s for s in secrets if s and s in text]


def outcome_text(outcome: JobOutcome) -> str:
    return json.dumps(
        {
            **outcome.summary(),
            "stdout": outcome.stdout_tail,
            "stderr": outcome.stderr_tail,
            "result": outcome.result,
        },
        default=str,
    )
