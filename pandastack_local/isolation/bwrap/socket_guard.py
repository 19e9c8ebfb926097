"""The socket guard: socket buffers that no cgroup charges cannot pile up past a sandbox's budget.

Two kinds of socket memory escape a sandbox's memory cgroup (measured on Linux 6.18, issue 23):

- netlink messages, on cgroup v1 and v2 alike: the kernel charges them to no cgroup. seccomp leaves
  a job NETLINK_ROUTE only, but its error replies echo each request back whole, so every unread
  routing socket holds about 200 KiB, however many sockets a job opens;
- on cgroup v1, TCP buffers past ``memory.kmem.tcp``'s limit (``cgroups.py``): the kernel still
  grants every TCP socket one more segment (a forced charge, so that each connection can make
  progress), which thousands of sockets turn into hundreds of MiB.

Every ``POLL_SECONDS`` (20 ms; longer with many sandboxes, see ``CPU_SHARE``) the guard reads both
for each live sandbox (``memory.kmem.tcp.usage_in_bytes`` and the Rmem and Wmem columns of the
sandbox's own ``/proc/net/netlink``) and, once they pass its budget, does what the OOM killer does
when memory runs out: SIGKILL to every process of the sandbox but the agent. The job's exec ends
with 137 and the sandbox lives on. A flood is cut off within one interval of passing the budget,
not before: it overshoots by what it queues in that time (a Python flood queues up to about 1.5 GB
a second on this 2-core host: some 30 MiB per interval).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

from pandastack_local.isolation.cgroups import MIB, Cgroups, socket_budget
from pandastack_local.isolation.process import SandboxProcess, host_descendants
from pandastack_local.templates.registry import Template

log = logging.getLogger(__name__)

# How often the guard looks: every POLL_SECONDS, or less often when looking at every sandbox takes
# longer than CPU_SHARE of that (about 30 us a sandbox: 100 sandboxes are looked at every 0.15 s).
POLL_SECONDS = 0.02
CPU_SHARE = 0.02
# After a kill, how long the guard leaves the sandbox be while the dead job's buffers are freed.
COOLDOWN_SECONDS = 1.0
# Netlink buffers a sandbox may hold whatever its budget (a routing query's answer is a few KiB).
NETLINK_MAX_BYTES = 8 * MIB
# The most of a sandbox's /proc/net/netlink read per poll (about 2,500 sockets; the kernel's own
# are about ten): a sandbox with more is over its budget by that alone.
NETLINK_TABLE_MAX_BYTES = 256 * 1024
OVER_ANY_BUDGET = 1 << 40


@dataclass
class _Watched:
    sp: SandboxProcess
    budget: int
    agent: int = 0  # the agent's host pid (bwrap's one child: the sandbox's PID 1), once known
    quiet_until: float = 0.0  # monotonic time: after a kill, the guard waits for the memory to go


def netlink_bytes(pid: int) -> int | None:
    """Bytes queued on the netlink sockets of ``pid``'s network namespace (None: unreadable)."""
    try:
        fd = os.open(f"/proc/{pid}/net/netlink", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        table = f.read(NETLINK_TABLE_MAX_BYTES + 1)
    if len(table) > NETLINK_TABLE_MAX_BYTES:
        return OVER_ANY_BUDGET
    total = 0
    for line in table.splitlines()[1:]:  # sk Eth Pid Groups Rmem Wmem Dump Locks Drops Inode
        fields = line.split()
        if len(fields) >= 6 and fields[4].isdigit() and fields[5].isdigit():
            total += int(fields[4]) + int(fields[5])
    return total


def _agent_pid(bwrap_pid: int) -> int:
    """bwrap's child in the sandbox's network namespace: the agent (``--as-pid-1``); 0 while there
    is none yet (the launch wrapper's own children live in the host's namespace)."""
    try:
        with open(f"/proc/{bwrap_pid}/task/{bwrap_pid}/children") as f:
            children = [int(c) for c in f.read().split()]
        host_netns = os.stat("/proc/self/ns/net").st_ino
    except (OSError, ValueError):
        return 0
    for child in children:
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{child}/ns/net").st_ino != host_netns:
                return child
    return 0


class SocketGuard:
    """One thread for all of a server's sandboxes (see the module docstring)."""

    def __init__(self, cgroups: Cgroups) -> None:
        self.cgroups = cgroups
        self._watched: dict[str, _Watched] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, sp: SandboxProcess, template: Template) -> None:
        with self._lock:
            self._watched[sp.name] = _Watched(sp, socket_budget(template))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="socket-guard", daemon=True)
                self._thread.start()

    def forget(self, name: str) -> None:
        with self._lock:
            self._watched.pop(name, None)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        interval = POLL_SECONDS
        while not self._stop.wait(interval):
            started = time.monotonic()
            with self._lock:
                watched = list(self._watched.values())
            for w in watched:
                try:
                    self._check(w)
                except Exception:  # the guard must outlive any one sandbox's state
                    log.exception("socket guard: checking sandbox %s failed", w.sp.name)
            interval = max(POLL_SECONDS, (time.monotonic() - started) / CPU_SHARE)

    def _check(self, w: _Watched) -> None:
        w.agent = w.agent or _agent_pid(w.sp.pid)
        if not w.agent or time.monotonic() < w.quiet_until:
            return
        netlink = netlink_bytes(w.agent)
        if netlink is None:  # not (or no longer) readable: look for the agent again next time
            w.agent = 0
            return
        held = netlink + (self.cgroups.socket_bytes(w.sp.name) or 0)
        if held <= w.budget and netlink <= NETLINK_MAX_BYTES:
            return
        killed = self._kill_job(w)
        w.quiet_until = time.monotonic() + COOLDOWN_SECONDS
        log.warning(
            "sandbox %s: its sockets held %d MiB (%d MiB of them netlink) that its memory cgroup does "
            "not charge, past its %d MiB socket budget: killed its %d job processes, as the OOM "
            "killer would",
            w.sp.name,
            held // MIB,
            netlink // MIB,
            w.budget // MIB,
            killed,
        )

    def _kill_job(self, w: _Watched) -> int:
        return kill_job(self.cgroups, w.sp, w.agent) or 0


def kill_job(cgroups: Cgroups, sp: SandboxProcess, agent: int = 0) -> int | None:
    """SIGKILL every process of the sandbox but bwrap and the agent (its job's exec answers 137,
    as after an OOM kill; the sandbox lives); again, for what forked meanwhile. None when the agent
    cannot be told apart (not up, or gone). (No freezer: thawing afterwards would resume a sandbox
    its client paused.)"""
    agent = agent or _agent_pid(sp.pid)
    if not agent:
        return None
    killed: set[int] = set()
    for _ in range(3):
        pids = cgroups.pids(sp.name) or host_descendants(sp.pid)
        victims = [pid for pid in pids if pid not in (sp.pid, agent, *killed)]
        if not victims:
            break
        for pid in victims:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        killed.update(victims)
    return len(killed)
