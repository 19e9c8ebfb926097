"""What both backends share: a sandbox's host process, its launch into its cgroups, its kill,
and the start-up reap of what a crashed server left.

A sandbox's host dir may hold what its guest wrote (gVisor's socket dir is bound into the
guest), so its deletion trusts nothing in it: ``remove_tree`` works by file descriptor, never
follows a symlink, never recurses, and holds two descriptors at most, whatever the depth. A
kill deletes inline for ``REMOVE_SECONDS`` at most; the start-up reap only moves leftovers into
``reaped/`` (a rename each), and a background thread deletes them, so no tree can hold a
DELETE or a server start.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pandastack_local.guest.agent import ProcessTable, _processes, descendants
from pandastack_local.isolation.cgroups import Cgroups

GUEST_PYTHON = "/usr/bin/python3"
SETPRIV = "/usr/bin/setpriv"
# Of the sandbox's disk cap, this much at most is its /dev/shm (the rest is its root).
SHM_MAX_BYTES = 64 * 1024 * 1024
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with its NUL
# How long a kill deletes its sandbox's host dir inline; the rest is finished in the background.
REMOVE_SECONDS = 5.0
RECORD_MAX_BYTES = 4096
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

log = logging.getLogger(__name__)


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
# Every host process of a sandbox (bwrap and its agent, gVisor's sentry and gofer) is this far
# ahead of the server (-900, or 0 when it may not lower its score) and of an orchestrator (0) in
# the host OOM killer's line; its jobs (guest/agent.py's OOM_FIRST) are further ahead still, at
# 1000. Raising a score needs no privilege; written by a root server's launch shell, it is also
# the floor (the kernel's oom_score_adj_min): nothing in the sandbox may lower itself below it.
SANDBOX_OOM_SCORE_ADJ = 800
JOIN_CGROUPS = 'echo "$PS_CGROUPS" | while read -r f; do echo $$ > "$f"; done; unset PS_CGROUPS; '
OOM_AHEAD = f"echo {SANDBOX_OOM_SCORE_ADJ} > /proc/self/oom_score_adj 2>/dev/null; "


def keep_ahead(
    name: str, pids: list[int], floor: int = SANDBOX_OOM_SCORE_ADJ, launcher: int | None = None
) -> int:
    """Raise back to ``floor`` the OOM score of every process of sandbox ``name`` that lowered
    its own (or its agent's): a server that may not lower its own score sets no floor
    (``oom_score_adj_min`` needs CAP_SYS_RESOURCE), so without this a job can stand level with the
    server. Each process is pinned by a ``/proc/<pid>`` descriptor and checked to be the
    sandbox's before the write (in its cgroup; on a host without cgroups, below its ``launcher``),
    so a reused pid is never touched. How many were raised."""
    raised = 0
    below: set[int] = set() if launcher is None else {launcher}  # checked this call: walks stop there
    for pid in pids:
        try:
            fd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            adj = _read_at(fd, "oom_score_adj")
            if adj is None or int(adj) >= floor:
                continue
            if launcher is None and name not in (_read_at(fd, "cgroup") or ""):
                continue
            if launcher is not None and not _descends_from(_read_at(fd, "stat"), launcher, below):
                continue
            out = os.open("oom_score_adj", os.O_WRONLY, dir_fd=fd)
            try:
                os.write(out, str(floor).encode())
                raised += 1
            finally:
                os.close(out)
        except (OSError, ValueError):
            continue
        finally:
            os.close(fd)
    return raised


def _descends_from(stat_text: str | None, ancestor: int, below: set[int] | None = None) -> bool:
    """Whether the process whose ``/proc/<pid>/stat`` is ``stat_text`` has ``ancestor`` above it.
    A sandbox's processes stay below its launcher (its pid namespace's init adopts orphans), at
    any depth; a loop (a pid reused mid-walk) ends the walk. ``below``: pids already found below
    ``ancestor`` (``ancestor`` among them) by this caller moments ago: a walk that meets one stops
    there, and the parents it read join them. So a pass over a deep chain reads each parent once,
    not once per process under it (a chain of 250 made every pass ten times longer)."""
    below = {ancestor} if below is None else below
    seen: set[int] = set()
    while True:
        try:
            ppid = int((stat_text or "").rsplit(")", 1)[1].split()[1])
        except (IndexError, ValueError):
            return False
        if ppid in below:
            below.update(seen)
            return True
        if ppid <= 1 or ppid in seen:
            return False
        seen.add(ppid)
        try:
            stat_text = Path(f"/proc/{ppid}/stat").read_text()
        except OSError:
            return False


def _read_at(fd: int, name: str) -> str | None:
    try:
        f = os.open(name, os.O_RDONLY, dir_fd=fd)
    except OSError:
        return None
    try:
        return os.read(f, 65536).decode(errors="replace")
    finally:
        os.close(f)


def launch(
    argv: list[str],
    procs_files: list[Path],
    pass_fds: tuple[int, ...] = (),
    pdeathsig: bool = False,
    uid: int | None = None,
    stdin: int | None = None,
    stdout: int | None = None,
) -> subprocess.Popen[bytes]:
    """Start a sandbox's first process inside its cgroups: a tiny ``sh`` joins them (and puts the
    sandbox ahead of the server and its neighbours' orchestrators in the host OOM killer's line:
    ``SANDBOX_OOM_SCORE_ADJ``), then execs ``argv``, so nothing of the sandbox runs
    unlimited. ``uid``: drop to it (and no groups) right before ``argv`` (a root server's
    per-sandbox uid). ``stdin``, ``stdout``: fds for its stdin and stdout (default /dev/null).

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
    script = OOM_AHEAD + 'exec "$@"'
    if procs_files:
        env["PS_CGROUPS"] = "\n".join(str(p) for p in procs_files)
        script = JOIN_CGROUPS + script
    if pdeathsig:
        argv = [SETPRIV, "--pdeathsig", "KILL", "/bin/sh", "-c", PARENT_CHECK + script, "sh", parent, *argv]
    else:
        argv = ["/bin/sh", "-c", script, "sh", *argv]
    return subprocess.Popen(
        argv,
        pass_fds=pass_fds,
        stdin=subprocess.DEVNULL if stdin is None else stdin,
        stdout=subprocess.DEVNULL if stdout is None else stdout,
        stderr=subprocess.DEVNULL if not os.environ.get("PANDASTACK_LOCAL_DEBUG") else None,
        env=env,
        cwd="/",
    )


def host_descendants(pid: int, table: ProcessTable | None = None) -> list[int]:
    """Host pids below ``pid`` (used when no cgroup lists the sandbox's processes). ``table``: one
    walk of the host's /proc (``host_processes()``) shared by every sandbox of a pass."""
    return descendants(pid, table)


def host_processes() -> ProcessTable:
    """(pid, state, parent pid, session id) of every host process: one /proc walk."""
    return _processes()


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
    discard(sp.directory)


def stop(sp: SandboxProcess, cgroups: Cgroups) -> bool:
    """Stop a sandbox at once: SIGKILL its init and every process in its cgroups, so nothing of
    it runs or answers any more. Its removal (waiting for the processes, its cgroups, its host dir,
    what the backend holds) is :func:`kill`'s, which may run later. False on a host without
    cgroups: only ``kill``'s /proc walk finds every process there."""
    if not cgroups.bases:
        return False
    with contextlib.suppress(OSError):
        sp.proc.send_signal(signal.SIGKILL)
    cgroups.kill(sp.name)
    return True


def reap_leftovers(sandboxes_dir: Path, cgroups: Cgroups) -> list[str]:
    """Start-up: kill what a crashed previous run left (processes, cgroups) and move its host dirs
    into ``reaped/``, emptied in the background: however big a tree, the start does not wait."""
    reaped = set(cgroups.reap_all())
    if sandboxes_dir.is_dir():
        for directory in sandboxes_dir.iterdir():
            pid = _recorded_pid(directory)
            if pid is not None and _is_sandbox_init(pid):
                for victim in [pid, *host_descendants(pid)]:
                    with contextlib.suppress(OSError):
                        os.kill(victim, signal.SIGKILL)
            reaped.add(directory.name)
            _move_to_reaped(directory)
    if _reaped_dir(sandboxes_dir).is_dir():
        _empty_in_background(_reaped_dir(sandboxes_dir))
    return sorted(reaped)


def _recorded_pid(directory: Path) -> int | None:
    """The pid in a sandbox's ``record.json`` (the server's file: opened without following a link)."""
    try:
        fd = os.open(directory / "record.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return int(json.loads(os.read(fd, RECORD_MAX_BYTES))["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    finally:
        os.close(fd)


# ---- deleting what a guest may have written -----------------------------------------------------
def discard(directory: Path) -> None:
    """Delete a sandbox's host dir: inline for REMOVE_SECONDS at most; what is left then (or what
    changed under the deletion) goes to ``reaped/`` and is finished in the background."""
    try:
        if remove_tree(directory, time.monotonic() + REMOVE_SECONDS):
            return
    except OSError as exc:
        log.warning("deleting %s: %s: finishing in the background", directory, exc)
    _move_to_reaped(directory)
    _empty_in_background(_reaped_dir(directory.parent))


def remove_tree(path: Path, deadline: float | None = None) -> bool:
    """Delete ``path`` and everything under it, trusting nothing in it: iteratively (no recursion
    for a deep tree to break), by file descriptor (depth is not bound by PATH_MAX), with every
    directory opened O_NOFOLLOW and checked to be the one listed (a symlink is unlinked, never
    entered), and two descriptors open at most. ``path``'s parent must be the server's own.
    True once ``path`` is gone; False when ``deadline`` (monotonic) passed or a directory moved
    during the deletion: the rest stays for a later call."""
    try:
        top = os.open(path.parent, _DIR_FLAGS)
    except FileNotFoundError:
        return True
    try:
        return _remove_entry(top, path.name, deadline)
    finally:
        os.close(top)


def _remove_entry(top: int, name: str, deadline: float | None) -> bool:
    try:
        st = os.stat(name, dir_fd=top, follow_symlinks=False)
    except FileNotFoundError:
        return True
    if not stat.S_ISDIR(st.st_mode):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=top)
        return True
    fd = _open_dir(top, name, st)
    if fd < 0:
        return False
    # The way down from ``top``: each level's name and (device, inode), to climb back by "..".
    names, ids = [name], [(st.st_dev, st.st_ino)]
    try:
        while True:
            if deadline is not None and time.monotonic() > deadline:
                return False
            sub = _unlink_files_until_a_dir(fd)
            if sub is not None:
                child = _open_dir(fd, *sub)
                if child < 0:
                    continue  # it changed since it was listed: look again
                os.close(fd)
                fd = child
                names.append(sub[0])
                ids.append((sub[1].st_dev, sub[1].st_ino))
                continue
            if len(names) == 1:
                os.close(fd)
                fd = -1
                with contextlib.suppress(FileNotFoundError):  # (another deletion got there first)
                    os.rmdir(name, dir_fd=top)
                return True
            up = os.open("..", _DIR_FLAGS, dir_fd=fd)
            up_st = os.fstat(up)
            if (up_st.st_dev, up_st.st_ino) != ids[-2]:  # moved: ".." is no longer where we came from
                os.close(up)
                return False
            os.close(fd)
            fd = up
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(names.pop(), dir_fd=fd)
            ids.pop()
    finally:
        if fd >= 0:
            os.close(fd)


def _open_dir(parent: int, name: str, listed: os.stat_result) -> int:
    """``name`` under ``parent`` as a directory fd, if it still is the directory ``listed``; else -1."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):  # gone, or now a file or a link
            return -1
        raise
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (listed.st_dev, listed.st_ino):
        os.close(fd)
        return -1
    return fd


def _unlink_files_until_a_dir(fd: int) -> tuple[str, os.stat_result] | None:
    """Unlink the entries of directory ``fd`` that are not directories (symlinks included) until
    one is: its (name, lstat); None once ``fd`` is empty."""
    with os.scandir(fd) as entries:  # closing rewinds the shared offset (fd-based scandir)
        for entry in entries:
            with contextlib.suppress(FileNotFoundError):  # (gone since it was listed)
                if entry.is_dir(follow_symlinks=False):
                    return entry.name, entry.stat(follow_symlinks=False)
                os.unlink(entry.name, dir_fd=fd)
    return None


def _reaped_dir(sandboxes_dir: Path) -> Path:
    """Where sandbox dirs wait for the background deletion: ``reaped/`` beside ``sandboxes/``."""
    return sandboxes_dir.parent / "reaped"


def _move_to_reaped(directory: Path) -> None:
    reaped = _reaped_dir(directory.parent)
    try:
        reaped.mkdir(mode=0o700, exist_ok=True)
        os.rename(directory, reaped / f"{directory.name}.{os.urandom(4).hex()}")
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not move %s aside for deletion: %s", directory, exc)


_reaping_lock = threading.Lock()
_reaping: dict[Path, bool] = {}  # reaped dir -> "look again when done" (a deletion is running)


def _empty_in_background(reaped: Path) -> None:
    """Delete everything in ``reaped`` on a daemon thread (one per directory at a time)."""
    with _reaping_lock:
        if reaped in _reaping:
            _reaping[reaped] = True
            return
        _reaping[reaped] = False
    threading.Thread(target=_empty, args=(reaped,), name="pandastack-reaper", daemon=True).start()


def _empty(reaped: Path) -> None:
    while True:
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(reaped):
                try:
                    if not remove_tree(reaped / name):
                        log.warning("could not delete %s: it changed during the deletion", reaped / name)
                except OSError as exc:
                    log.warning("could not delete %s: %s", reaped / name, exc)
        with _reaping_lock:
            if not _reaping[reaped]:
                del _reaping[reaped]
                return
            _reaping[reaped] = False


def _is_sandbox_init(pid: int) -> bool:
    """bwrap's, or the gVisor backend's runsc (a pid reused by anything else is left alone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
            return b"bwrap" in cmdline or b"runsc" in cmdline
    except OSError:
        return False
