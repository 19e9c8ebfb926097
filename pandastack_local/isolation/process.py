"""What both backends share: a sandbox's host process, its launch into its cgroups, its kill,
and the start-up reap of what a crashed server left."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pandastack_local.isolation.cgroups import Cgroups

GUEST_PYTHON = "/usr/bin/python3"
SETPRIV = "/usr/bin/setpriv"
# Of the sandbox's disk cap, this much at most is its /dev/shm (the rest is its root).
SHM_MAX_BYTES = 64 * 1024 * 1024
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with its NUL


@dataclass
class SandboxProcess:
    """A running sandbox: its first host process (bwrap or runsc), its agent socket and its host dir."""

    name: str
    proc: subprocess.Popen[bytes]
    directory: Path
    socket_path: Path
    # Run by kill() before the processes go (e.g. the egress relay closes its listeners).
    on_kill: list[Callable[[], None]] = field(default_factory=list)
    # Started from a checkpoint image (gVisor: a boot image or a fork), not booted.
    restored: bool = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None


def disk_split(disk_bytes: int) -> tuple[int, int]:
    """(root tmpfs bytes, /dev/shm tmpfs bytes): both together are the template's disk cap."""
    shm = min(SHM_MAX_BYTES, disk_bytes // 4)
    return disk_bytes - shm, shm


# The first lines of every sandbox's first shell: its parent must still be the server (the pid
# passed as $1). A server that died before the parent-death signal was set (PR_SET_PDEATHSIG, by
# setpriv right before this shell) reparented it: it exits instead of starting a sandbox nobody owns.
PARENT_CHECK = '[ "$PPID" = "$1" ] || exit 125; shift; '
JOIN_CGROUPS = 'echo "$PS_CGROUPS" | while read -r f; do echo $$ > "$f"; done; unset PS_CGROUPS; '


def launch(
    argv: list[str],
    procs_files: list[Path],
    pass_fds: tuple[int, ...] = (),
    pdeathsig: bool = False,
    uid: int | None = None,
) -> subprocess.Popen[bytes]:
    """Start a sandbox's first process inside its cgroups: a tiny ``sh`` joins them, then execs
    ``argv``, so nothing of the sandbox runs unlimited. ``uid``: drop to it (and no groups) right
    before ``argv`` (a root server's per-sandbox uid).

    ``pdeathsig``: the sandbox dies with the server, also when the server dies while this very
    launch is under way. Every process of the chain has PR_SET_PDEATHSIG=SIGKILL from its first
    instruction on (setpriv sets it, exec keeps it; a uid change clears it, so the uid-dropping
    setpriv sets it again), and each shell then checks that its parent is still the server: one
    that died before a signal could be set left it reparented, and it exits. The signal follows the
    spawning *thread*: call this on a thread that lives as long as the server (the event loop's).
    bwrap's sandboxes go without (see ``bwrap.sandbox.spawn``: their agent's lifeline does it)."""
    env = {"PATH": "/usr/bin:/bin"}
    parent = str(os.getpid())
    if uid is not None:
        drop = [SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        if pdeathsig:
            drop += ["--pdeathsig", "KILL", "/bin/sh", "-c", PARENT_CHECK + 'exec "$@"', "sh", parent]
        argv = [*drop, *argv]
    script = 'exec "$@"'
    if procs_files:
        env["PS_CGROUPS"] = "\n".join(str(p) for p in procs_files)
        script = JOIN_CGROUPS + script
    if pdeathsig:
        argv = [SETPRIV, "--pdeathsig", "KILL", "/bin/sh", "-c", PARENT_CHECK + script, "sh", parent, *argv]
    elif procs_files:
        argv = ["/bin/sh", "-c", script, "sh", *argv]
    return subprocess.Popen(
        argv,
        pass_fds=pass_fds,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL if not os.environ.get("PANDASTACK_LOCAL_DEBUG") else None,
        env=env,
        cwd="/",
    )


def host_descendants(pid: int) -> list[int]:
    """Host pids below ``pid`` (used when no cgroup lists the sandbox's processes)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        ppid = int(data[data.rfind(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill(sp: SandboxProcess, cgroups: Cgroups) -> None:
    """Kill every process of the sandbox, remove its cgroups and its host dir."""
    for hook in sp.on_kill:
        with contextlib.suppress(Exception):
            hook()
    # Every process of the sandbox is in its cgroups (joined before bwrap or runsc started), and
    # cgroups.remove kills them there: the /proc walk is only for a host with no cgroups.
    victims = host_descendants(sp.pid) if sp.alive() and not cgroups.bases else []
    with contextlib.suppress(OSError):
        sp.proc.send_signal(signal.SIGKILL)
    for pid in victims:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    cgroups.remove(sp.name)
    with contextlib.suppress(subprocess.TimeoutExpired):
        sp.proc.wait(timeout=5)
    shutil.rmtree(sp.directory, ignore_errors=True)


def reap_leftovers(sandboxes_dir: Path, cgroups: Cgroups) -> list[str]:
    """Start-up: kill and remove what a crashed previous run left (host dirs, processes, cgroups)."""
    reaped = set(cgroups.reap_all())
    if sandboxes_dir.is_dir():
        for directory in sandboxes_dir.iterdir():
            record = directory / "record.json"
            with contextlib.suppress(OSError, ValueError):
                pid = int(json.loads(record.read_text())["pid"])
                if _is_sandbox_init(pid):
                    for victim in [pid, *host_descendants(pid)]:
                        with contextlib.suppress(OSError):
                            os.kill(victim, signal.SIGKILL)
            reaped.add(directory.name)
            shutil.rmtree(directory, ignore_errors=True)
    return sorted(reaped)


def _is_sandbox_init(pid: int) -> bool:
    """bwrap's, or the gVisor backend's runsc (a pid reused by anything else is left alone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
            return b"bwrap" in cmdline or b"runsc" in cmdline
    except OSError:
        return False
