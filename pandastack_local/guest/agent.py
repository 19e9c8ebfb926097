"""The in-sandbox agent, and the frame protocol the server speaks with it.

This file runs in two places. Inside each sandbox it is the long-lived process
that bwrap starts (``/usr/bin/python3 -I -S /.pandastack/agent.pyc FD LIMITS``: this file compiled
once per server by that python, ``isolation/guest_dir.py``; gVisor's runs the source):
because it lives in the sandbox's namespaces, every exec and every file path it
touches resolves inside the sandbox and nowhere else. On the host the server
imports it only for the frame helpers and the /proc walk (``descendants``), so it must stay
stdlib-only and must not import anything from ``pandastack_local``.

Protocol: one unix-socket connection per operation. Every message is a frame:
``kind`` (1 byte) + ``length`` (4 bytes, big endian) + payload. The request is a
JSON frame, optionally followed by DATA frames and an END frame; the reply is
zero or more STDOUT/STDERR/DATA frames and one final JSON frame. While the agent handles a
connection it sends a BEAT frame (empty) on it every HEARTBEAT_SECONDS, whatever the operation is
doing: the server's proof that the agent is alive (``agent_client``: a connection silent for its
deadline means a stopped or hung agent, not a slow command).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import selectors
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

JSON, STDOUT, STDERR, DATA, END, BEAT = 0, 1, 2, 3, 4, 5
_HEADER = struct.Struct("!BI")
HEARTBEAT_SECONDS = 1.0
BEAT_FRAME = _HEADER.pack(BEAT, 0)
MAX_FRAME = 1 << 20
CHUNK = 64 * 1024
# The most a file read sends (the server asks for its own cap; this is the fallback).
MAX_READ_BYTES = 32 * 1024 * 1024
# errno names for refusals that are the file's fault, not the agent's (the server maps them to 4xx).
NOT_REGULAR = "EFTYPE"
TOO_BIG = "EFBIG"
# A delete whose path resolves to the sandbox's root (``/proc/self/root/``, ``/proc/1/cwd/``...).
IS_ROOT = "EISROOT"
# Tar headers and block padding a fork's copy carries on top of its file data.
TAR_OVERHEAD_BYTES = 1024 * 1024
# The exec's output is drained for this long after its shell exits, so a
# background process that kept stdout open cannot hold the exec forever.
DRAIN_GRACE_SECONDS = 0.3
# Checkpointing (gVisor fork): how long the agent waits for other requests to finish.
QUIESCE_WAIT_SECONDS = 5.0
# Every exec runs first in line for the kernel's OOM killer, so a job that fills its sandbox's
# memory (even with tmpfs pages, which are in no process's RSS) is killed (exit 137), not the agent.
OOM_FIRST = "echo 1000 >/proc/self/oom_score_adj 2>/dev/null; "
# PATH comes from the sandbox (a python_env template puts its bin first).
GUEST_ENV = {
    "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"),
    "HOME": "/root",
    "LANG": "C.UTF-8",
}
# Top-level names that belong to the host's read-only system view or to the
# kernel, never to the sandbox's own disk (skipped by the fork disk copy).
NOT_DISK = {"proc", "dev", "sys", "usr", ".pandastack", ".pandastack-rootfs", "bin", "lib", "lib64", "sbin"}


# Read-only binds inside the sandbox's own tree (not part of its disk either).
NOT_DISK_PATHS = {"etc/alternatives", "opt/pandastack"}


def pack(kind: int, payload: bytes) -> bytes:
    return _HEADER.pack(kind, len(payload)) + payload


def pack_json(obj: Any) -> bytes:
    return pack(JSON, json.dumps(obj).encode())


def _recv_exact(sock: Conn, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("peer closed")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: Conn) -> tuple[int, bytes]:
    kind, length = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if length > MAX_FRAME:
        raise ValueError("frame too large")
    return kind, _recv_exact(sock, length) if length else b""


class FrameReader:
    """File-like reader over DATA frames, ending at an END frame (for tarfile)."""

    def __init__(self, sock: Conn) -> None:
        self.sock = sock
        self.buf = b""
        self.done = False

    def read(self, n: int = -1) -> bytes:
        while not self.done and (n < 0 or len(self.buf) < n):
            kind, payload = recv_frame(self.sock)
            if kind == END:
                self.done = True
            elif kind == DATA:
                self.buf += payload
            else:
                raise ValueError("unexpected frame")
        if n < 0:
            out, self.buf = self.buf, b""
        else:
            out, self.buf = self.buf[:n], self.buf[n:]
        return out


class FrameWriter:
    """File-like writer that sends DATA frames (for tarfile)."""

    def __init__(self, sock: Conn) -> None:
        self.sock = sock

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        for i in range(0, len(view), CHUNK):
            self.sock.sendall(pack(DATA, bytes(view[i : i + CHUNK])))
        return len(data)

    def flush(self) -> None:
        pass


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


# (pid, state, parent pid, session id) of every process: one walk of /proc (``_processes``).
ProcessTable = list[tuple[int, bytes, int, int]]


def _processes() -> ProcessTable:
    """(pid, state, parent pid, session id) of every process of this sandbox, from /proc: the one
    walk behind the exec's tree kill, the reaper and a code context's close."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rfind(b")") + 2 :].split()
        if len(fields) > 3:
            out.append((int(name), fields[0], int(fields[1]), int(fields[3])))
    return out


def _session_pids(sid: int) -> list[int]:
    """Every process of this sandbox in session ``sid`` (the exec's tree)."""
    return [pid for pid, _state, _ppid, session in _processes() if session == sid]


def _kill_until_gone(find: Callable[[], list[int]], rounds: int, pause: float) -> None:
    """SIGKILL what ``find`` lists until it lists nothing (a process forking as it dies leaves a
    child the next round finds), ``rounds`` times at most."""
    for _ in range(rounds):
        pids = find()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(pause)


def _kill_tree(sid: int) -> None:
    _kill_until_gone(lambda: _session_pids(sid), 3, 0.01)


class ClientGone(Exception):
    """The server closed the exec's connection: its client went away."""


# The agent is the sandbox's PID 1 (bwrap --as-pid-1, gVisor's init): every orphan of a job is
# reparented to it, and it must reap them as an init does. It never reaps a child it waits for
# itself (an exec's shell, a code context's python): that exit status belongs to its own wait.
# A child is registered under the lock it was started under, so the reaper never sees it unowned.
_CHILDREN_LOCK = threading.Lock()
_OWN_CHILDREN: set[int] = set()
_CHILD_STARTED = threading.Event()  # wakes the reaper when the agent had no child at all


def start_child(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    with _CHILDREN_LOCK:
        proc = subprocess.Popen(argv, **kwargs)
        _OWN_CHILDREN.add(proc.pid)
    _CHILD_STARTED.set()
    return proc


def _disown(proc: subprocess.Popen[bytes]) -> None:
    """``proc`` is waited for (or given up on): from now on the reaper may collect it."""
    _OWN_CHILDREN.discard(proc.pid)


def _zombie_children() -> list[int]:
    me = os.getpid()
    return [pid for pid, state, ppid, _sid in _processes() if state == b"Z" and ppid == me]


def reap_orphans() -> None:
    """Runs for the agent's life: wait until a child has exited (without collecting it), then
    collect every exited child that is not the agent's own."""
    while True:
        try:
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # no child at all: orphans come only from a child's tree
            _CHILD_STARTED.wait()
            _CHILD_STARTED.clear()
            continue
        reaped = 0
        with _CHILDREN_LOCK:
            for pid in _zombie_children():
                if pid not in _OWN_CHILDREN:
                    try:
                        os.waitpid(pid, os.WNOHANG)
                        reaped += 1
                    except ChildProcessError:
                        pass
        if not reaped:  # the exited child is one the agent waits for itself: give it a moment
            time.sleep(0.05)


def op_exec(sock: Conn, req: dict[str, Any]) -> None:
    timeout = float(req.get("timeout_seconds") or 0)
    try:
        proc = start_child(
            ["/bin/sh", "-c", OOM_FIRST + req["cmd"]],
            stdin=0,  # the agent's own /dev/null (main): opened once, whatever a job does to the node
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=req.get("cwd") or "/root",
            env=GUEST_ENV,
            start_new_session=True,
        )
    except (OSError, ValueError) as exc:  # E2BIG, EMFILE, EAGAIN, a missing cwd: say so, at once
        sock.sendall(pack_json({"error": f"exec could not start: {exc}"}))
        return
    assert proc.stdout is not None and proc.stderr is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, STDOUT)
    sel.register(proc.stderr, selectors.EVENT_READ, STDERR)
    # The server sends nothing after the request: the socket turning readable means it hung up.
    sel.register(sock, selectors.EVENT_READ, None)
    deadline = time.monotonic() + timeout if timeout > 0 else None
    drain_until: float | None = None
    timed_out = False
    try:
        while sel.get_map():
            now = time.monotonic()
            if proc.poll() is not None and drain_until is None:
                drain_until = now + DRAIN_GRACE_SECONDS
            if drain_until is not None and now >= drain_until:
                break
            if deadline is not None and now >= deadline and proc.returncode is None:
                timed_out = True
                _kill_tree(proc.pid)
                break
            wait = 0.05
            if deadline is not None:
                wait = min(wait, max(deadline - now, 0.0))
            for key, _ in sel.select(wait):
                if key.data is None:
                    raise ClientGone
                chunk = os.read(key.fd, CHUNK)
                if chunk:
                    sock.sendall(pack(key.data, chunk))
                else:
                    sel.unregister(key.fileobj)
            if len(sel.get_map()) == 1:  # both pipes closed: only the hang-up watch is left
                break
        if timed_out:
            proc.wait()
            sock.sendall(
                pack_json(
                    {
                        "error": f"exec timeout: command exceeded timeout_seconds="
                        f"{req.get('timeout_seconds')} and its process tree was killed",
                        "timeout": True,
                    }
                )
            )
            return
        proc.wait()
        sock.sendall(pack_json({"exit_code": _exit_code(proc.returncode)}))
    except (OSError, ClientGone):
        # The server went away (its client disconnected): the exec dies with its request.
        _kill_tree(proc.pid)
        proc.wait()
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
        _disown(proc)


def _fs_error(op: str, path: str, exc: OSError) -> dict[str, Any]:
    """The OS's refusal, naming the path asked for, the reason and its errno (and the file the
    OS refused when that is another one, e.g. inside a tree being deleted)."""
    code = errno.errorcode.get(exc.errno or 0, "")
    where = ""
    if exc.filename and os.fsdecode(exc.filename) != path:
        where = f" at {printable(os.fsdecode(exc.filename))}"
    reason = exc.strerror or str(exc)
    return {
        "error": f"{op} {path}: {reason} ({code}){where}" if code else f"{op} {path}: {reason}{where}",
        "errno": code,
    }


def printable(name: str) -> str:
    """A file name as JSON can carry it: the bytes that are not UTF-8 (decoded by Python as lone
    surrogates) each become U+FFFD, as the real server's Go JSON encoder writes them."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _type_letter(mode: int) -> str:
    """The file's type as the real server reports it (``find -printf %y``): f, d, l, c, b, p, s."""
    for test, letter in (
        (stat.S_ISREG, "f"),
        (stat.S_ISDIR, "d"),
        (stat.S_ISLNK, "l"),
        (stat.S_ISCHR, "c"),
        (stat.S_ISBLK, "b"),
        (stat.S_ISFIFO, "p"),
        (stat.S_ISSOCK, "s"),
    ):
        if test(mode):
            return letter
    return "U"


def _entry(name: str, st: os.stat_result) -> dict[str, Any]:
    return {
        "name": name,
        "is_dir": stat.S_ISDIR(st.st_mode),
        "size": st.st_size,
        "mode": _type_letter(st.st_mode),
        "mtime": int(st.st_mtime),
    }


_FILE_TYPES = {
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
}


class Refused(Exception):
    """A file operation refused because of what the file is (not an OS error)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def _refuse_irregular(mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = _FILE_TYPES.get(stat.S_IFMT(mode), "an unknown file type")
        raise Refused(f"not a regular file ({kind}): only regular files can be read or written", NOT_REGULAR)


def open_regular(path: str, flags: int) -> int:
    """Open ``path`` only if it is a regular file. O_NONBLOCK keeps a FIFO from hanging the
    open (the stat before it names the FIFO instead of failing with ENXIO on a write); the
    fstat after it closes the race. Blocking mode is restored for the regular file."""
    try:
        _refuse_irregular(os.stat(path).st_mode)
    except FileNotFoundError:
        if not flags & os.O_CREAT:
            raise
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        _refuse_irregular(os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_capped(sock: Conn, path: str, cap: int) -> None:
    """Send at most ``cap`` bytes of a regular file; a larger (sparse, growing) one is refused."""
    fd = open_regular(path, os.O_RDONLY)
    with os.fdopen(fd, "rb", buffering=0) as f:
        size = os.fstat(fd).st_size
        if size > cap:
            raise Refused(f"file is {size} bytes, over the {cap}-byte read cap", TOO_BIG)
        sent = 0
        while chunk := f.read(min(CHUNK, cap + 1 - sent)):
            sent += len(chunk)
            if sent > cap:
                raise Refused(f"file grew past the {cap}-byte read cap while it was read", TOO_BIG)
            sock.sendall(pack(DATA, chunk))


def list_capped(sock: Conn, path: str, cap: int) -> None:
    """A directory's entries as a JSON list in DATA frames (a big directory does not fit one
    frame), at most ``cap`` bytes of it: a larger listing is refused while it is scanned."""
    entries: list[dict[str, Any]] = []
    size = 2
    with os.scandir(path) as it:
        for e in it:  # not followed, like the real server's find -printf %y: a link is "l"
            entry = _entry(printable(e.name), e.stat(follow_symlinks=False))
            size += len(json.dumps(entry)) + 2
            if size > cap:
                raise Refused(
                    f"the listing is over the {cap}-byte cap (more than {len(entries)} entries): list "
                    "a smaller directory, or use exec",
                    TOO_BIG,
                )
            entries.append(entry)
    entries.sort(key=lambda e: e["name"])
    FrameWriter(sock).write(json.dumps(entries).encode())


def _make_parents(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)`` without recursion: a client can name a path deeper
    than the agent's thread stack (os.makedirs recursed once per level, and crashed it)."""
    if path and os.path.lexists(path) and not os.path.isdir(path):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)  # as os.makedirs
    missing = []
    while path and path != "/" and not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise


def op_fs(sock: Conn, req: dict[str, Any]) -> None:
    op, path = req["op"], req["path"]
    try:
        if op == "read":
            read_capped(sock, path, min(int(req.get("max_bytes") or MAX_READ_BYTES), MAX_READ_BYTES))
            sock.sendall(pack_json({"ok": True}))
        elif op == "write":
            reader = FrameReader(sock)
            try:
                _make_parents(os.path.dirname(path))
                fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            except (OSError, Refused):
                while reader.read(CHUNK):  # take the upload first, so the refusal is what the server reads
                    pass
                raise
            written = 0
            with os.fdopen(fd, "wb") as f:
                while chunk := reader.read(CHUNK):
                    f.write(chunk)
                    written += len(chunk)
            sock.sendall(pack_json({"ok": True, "bytes": written}))
        elif op == "stat":
            sock.sendall(
                pack_json({"ok": True, "entry": _entry(os.path.basename(path) or "/", os.stat(path))})
            )
        elif op == "list":
            list_capped(sock, path, min(int(req.get("max_bytes") or MAX_READ_BYTES), MAX_READ_BYTES))
            sock.sendall(pack_json({"ok": True}))
        elif op == "delete":
            _remove_all(path)
            sock.sendall(pack_json({"ok": True}))
        else:
            sock.sendall(pack_json({"error": f"unknown fs op {op}"}))
    except Refused as exc:
        sock.sendall(pack_json({"error": f"{op} {path}: {exc}", "errno": exc.code}))
    except OSError as exc:
        sock.sendall(pack_json(_fs_error(op, path, exc)))


def _delete_target(path: str) -> str:
    """The path a delete acts on, resolved as the OS resolves it: every link on the way is
    followed (``/proc/self/root/`` is ``/``), the last component only with a trailing slash or
    as ``.`` (a link is removed, not what it points to, as ``rm -rf`` does)."""
    stripped = path.rstrip("/")
    parent, name = os.path.split(stripped)
    if not stripped or path.endswith("/") or name == ".":
        return os.path.realpath(path)
    return os.path.join(os.path.realpath(parent or "/"), name)


def _remove_all(path: str) -> None:
    """Like Go's os.RemoveAll (a missing path is not an error), on the resolved path: the
    sandbox's root is refused however the path spells it, and so is the agent's own socket."""
    target = _delete_target(path)
    if target == "/":
        raise Refused(f"path {path!r} resolves to the sandbox's root (/): refusing to delete /", IS_ROOT)
    if SOCKET_DIR and (target == SOCKET_DIR or target.startswith(SOCKET_DIR + "/")):
        raise Refused(
            f"path {path!r} is the agent's socket: the server reaches the sandbox through it", "EACCES"
        )
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        _remove_dir_tree(target)
    else:
        os.unlink(target)


_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def _remove_dir_tree(path: str) -> None:
    """Delete the directory ``path`` and all below it without recursion (a job can make a tree
    deeper than Python's stack) and by descriptor (deeper than PATH_MAX), two open at most: go
    down to a directory with no subdirectory, unlinking files on the way, then climb by ".."."""
    parent, name = os.path.split(path.rstrip("/"))
    up = os.open(parent or "/", _DIR_OPEN)
    try:
        fd = os.open(name, _DIR_OPEN | os.O_NOFOLLOW, dir_fd=up)
    finally:
        os.close(up)
    names = [name]
    try:
        while names:
            with os.scandir(fd) as listing:
                entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in listing]
            sub = next((n for n, is_dir in entries if is_dir), None)
            for entry, is_dir in entries:
                if not is_dir:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry, dir_fd=fd)
            if sub is not None:
                child = os.open(sub, _DIR_OPEN | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd, names = child, [*names, sub]
                continue
            up = os.open("..", _DIR_OPEN, dir_fd=fd)
            os.close(fd)
            fd = up
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(names.pop(), dir_fd=fd)
    finally:
        os.close(fd)


def _disk_bytes(cap: int) -> tuple[int, str]:
    """The bytes a fork's copy would stream (apparent sizes: a sparse file's holes become real
    bytes in the child) and the largest sparse file, stopping early once past ``cap``."""
    total, sparse, sparse_size = 0, "", 0
    for name in sorted(os.listdir("/")):
        if name in NOT_DISK:
            continue
        for root, dirs, files in os.walk("/" + name):
            dirs[:] = [d for d in dirs if os.path.join(root, d)[1:] not in NOT_DISK_PATHS]
            for f in files:
                try:
                    st = os.lstat(os.path.join(root, f))
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                total += st.st_size
                if st.st_blocks * 512 < st.st_size and st.st_size > sparse_size:
                    sparse, sparse_size = os.path.join(root, f), st.st_size
                if total > cap:
                    return total, sparse
    return total, sparse


class CappedWriter(FrameWriter):
    """A FrameWriter that refuses to send more than ``cap`` bytes (a file grew mid-copy)."""

    def __init__(self, sock: Conn, cap: int) -> None:
        super().__init__(sock)
        self.cap = cap
        self.sent = 0

    def write(self, data: bytes) -> int:
        self.sent += len(data)
        if self.sent > self.cap + TAR_OVERHEAD_BYTES:
            raise Refused(f"the parent's files grew past the {self.cap}-byte fork copy cap", TOO_BIG)
        return super().write(data)


def op_tar_out(sock: Conn, req: dict[str, Any]) -> None:
    """Stream the sandbox's own disk (not the system view) as a tar, at most ``max_bytes`` of
    file data: the sizes are summed first, so a 1 TiB sparse file is refused in a moment
    instead of streaming a terabyte of zeros."""
    import tarfile

    cap = int(req.get("max_bytes") or 0) or (1 << 62)
    total, sparse = _disk_bytes(cap)
    if total > cap:
        hint = f" (sparse file {sparse} counts at its apparent size)" if sparse else ""
        raise Refused(
            f"fork refused: the parent's files hold over {cap} bytes{hint}, more than the "
            f"{cap}-byte fork copy cap (the sandbox's disk size); delete large files before forking",
            TOO_BIG,
        )

    def own_disk(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if info.name in NOT_DISK_PATHS else info

    with tarfile.open(fileobj=CappedWriter(sock, cap), mode="w|") as tar:  # type: ignore[call-overload]
        for name in sorted(os.listdir("/")):
            if name not in NOT_DISK:
                tar.add("/" + name, arcname=name, filter=own_disk)
    sock.sendall(pack(END, b""))
    sock.sendall(pack_json({"ok": True}))


def op_tar_in(sock: Conn, req: dict[str, Any]) -> None:
    import tarfile

    reader = FrameReader(sock)
    with tarfile.open(fileobj=reader, mode="r|") as tar:  # type: ignore[call-overload]
        for member in tar:
            if member.name.split("/")[0] in NOT_DISK or member.name.startswith(tuple(NOT_DISK_PATHS)):
                continue
            try:
                tar.extract(member, "/", set_attrs=member.isdir() is False)
            except OSError:
                continue
    reader.read()
    sock.sendall(pack_json({"ok": True}))


# Landlock (Linux 5.13+; not in gVisor): each code context runs in a Landlock domain of its own,
# entered before its python starts, and Landlock lets no process reach into (ptrace, /proc/<pid>/mem,
# /proc/<pid>/fd, pidfd_getfd) a process outside its own domain: contexts cannot read or forge each
# other, not even in the instant before a kernel makes itself non-dumpable.
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_RESTRICT_SELF = 444, 446  # the same on every architecture
LANDLOCK_ACCESS_FS_MAKE_BLOCK = 1 << 11  # a right only CAP_MKNOD has: handling it restricts nothing
PR_SET_NO_NEW_PRIVS = 38


def landlock_ruleset() -> int | None:
    """A Landlock ruleset's fd (close-on-exec), or None where the kernel has no Landlock."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        abi = int(libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))
        if abi < 1:
            return None
        # struct landlock_ruleset_attr {handled_access_fs, handled_access_net, scoped}: zeros past
        # what an older kernel knows are accepted. No signal scope here: the supervisor signals
        # the context's processes only, and the kernel below it scopes itself (repl_kernel.py).
        attr = (ctypes.c_uint64 * 3)(LANDLOCK_ACCESS_FS_MAKE_BLOCK, 0, 0)
        fd = int(
            libc.syscall(
                SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(24), ctypes.c_uint32(0)
            )
        )
    except (OSError, AttributeError):
        return None
    return fd if fd >= 0 else None


class Landlock:
    """Enter a new Landlock domain from a ruleset made once (``preexec_fn`` of a kernel: the
    child calls two syscalls through functions looked up before the fork)."""

    def __init__(self) -> None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        self.prctl, self.syscall, self.get_errno = libc.prctl, libc.syscall, ctypes.get_errno
        self.ruleset = landlock_ruleset()

    def enter(self) -> None:
        if self.ruleset is None:
            return
        if (
            self.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
            or self.syscall(SYS_LANDLOCK_RESTRICT_SELF, self.ruleset, 0) != 0
        ):
            raise OSError(self.get_errno(), "landlock_restrict_self failed")


LANDLOCK: Landlock | None = None


def descendants(root: int, table: ProcessTable | None = None) -> list[int]:
    """Every process below ``root`` (children, theirs, ...) in this pid namespace: in the sandbox
    a code context's supervisor is a subreaper, so what the context started stays below it
    whatever its session; the host walks its own /proc with it (``isolation.process``).
    ``table``: a walk already made (``_processes()``), shared by several roots."""
    children: dict[int, list[int]] = {}
    for pid, _state, ppid, _sid in _processes() if table is None else table:
        children.setdefault(ppid, []).append(pid)
    out, todo, seen = [], [root], {root}
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in seen:  # a torn walk (a pid reused during it) may hold a parent loop
                seen.add(child)
                out.append(child)
                todo.append(child)
    return out


def _kill_descendants(root: int) -> None:
    """SIGKILL everything below ``root`` until nothing is left."""
    _kill_until_gone(lambda: descendants(root), 100, 0.005)


def _start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return ""
    return data[data.rfind(b")") + 2 :].split()[19].decode()


def _token() -> str:
    return os.urandom(16).hex()


class ClientLeft(Exception):
    """The server hung up while a run waited for its reply: its client went away."""


# After its client left, a run is interrupted and has this long to answer before it is killed.
INTERRUPT_GRACE_SECONDS = 5.0


class CodeContext:
    """A code context's Python process (``repl_kernel.py``), reached through a socket pair.

    The process the agent starts is the context's supervisor: it makes itself non-dumpable and a
    subreaper, forks the kernel proper (non-dumpable too, in a nested Landlock domain that cannot
    signal out of it) and reaps every orphan of the context, so ``close()`` finds and kills all
    the context started, ``setsid`` or not. Each request carries a fresh random token and only the
    reply line that carries it back is taken: a line written into the channel by anything else
    is never attributed to the context.
    """

    def __init__(self, caps: dict[str, int]) -> None:
        global LANDLOCK
        if LANDLOCK is None:
            LANDLOCK = Landlock()
        # One socket pair, not two pipes: a pipe can be opened again through /proc/<pid>/fd/N by
        # any process allowed to look (gVisor does not apply dumpability there); a socket cannot.
        self.chan, kernel_end = socket.socketpair()
        self.lock = threading.Lock()
        self.created, self.cells, self.closed, self.pending = time.time(), 0, False, b""
        self.kernel, self.kernel_start = 0, ""
        try:
            self.proc = start_child(
                ["python3", "-u", "/.pandastack/repl_kernel.py", json.dumps(caps), str(kernel_end.fileno())],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd="/root",
                env=GUEST_ENV,
                start_new_session=True,
                pass_fds=(kernel_end.fileno(),),
                preexec_fn=LANDLOCK.enter if LANDLOCK.ruleset is not None else None,
            )
        except (OSError, subprocess.SubprocessError) as exc:  # no python3, no process to be had
            self.chan.close()
            raise Refused(f"the code context's python3 could not start: {exc}", "ENOEXEC") from exc
        finally:
            kernel_end.close()

    def start(self, deadline: float) -> str:
        """Wait for the kernel's hello; "" when it is ready, else why not."""
        token = _token()
        if not self.send({"hello": token}):
            return f"exited (code {self.proc.wait()})"
        line, why = self.reply(deadline, CHUNK, token)
        if not line:
            return why
        try:
            self.kernel = int(json.loads(line)["pid"])
        except (ValueError, KeyError, TypeError):
            return "answered its hello with something that is not its hello"
        self.kernel_start = _start_time(self.kernel)
        return ""

    def send(self, request: dict[str, Any]) -> bool:
        """Write one request line; False if the process is gone."""
        try:
            self.chan.sendall(json.dumps(request).encode() + b"\n")
        except OSError:
            return False
        return True

    def reply(self, deadline: float, cap: int, token: str, hangup: Conn | None = None) -> tuple[bytes, str]:
        """The reply line carrying ``token``, by ``deadline``, or b"" and why not; at most ``cap``
        bytes are read for it. A line without the token is dropped (code in a context can write to
        its channel); what came after the reply waits for the next call. ``hangup``: the server's
        connection, whose turning readable means it hung up (raises ClientLeft)."""
        mark = b'{"token": "' + token.encode() + b'"'
        buf = bytearray(self.pending)  # bytearray and a search of new bytes only: linear in the reply
        read, scanned = 0, 0
        watched: list[Any] = [self.chan] if hangup is None else [self.chan, hangup]
        while True:
            end = buf.find(b"\n", scanned)
            if end >= 0:
                line = bytes(buf[: end + 1])
                del buf[: end + 1]
                scanned = 0
                at = line.find(mark)
                if at >= 0:
                    self.pending = bytes(buf)
                    return line[at:], ""
                continue  # not the kernel's reply to this request: never taken as one
            scanned = len(buf)
            left = deadline - time.monotonic()
            if left <= 0:
                self.pending = b""
                return b"", "did not answer in time and was killed"
            if read > cap:
                self.pending = b""
                return b"", f"sent a reply over the {cap}-byte cap and was killed"
            ready = select.select(watched, [], [], min(left, 1.0))[0]
            if hangup is not None and hangup in ready:
                self.pending = bytes(buf)
                raise ClientLeft
            if self.chan not in ready:
                continue
            try:
                chunk = self.chan.recv(CHUNK)
            except OSError:
                chunk = b""
            if not chunk:
                self.pending = b""
                return b"", f"exited (code {self.proc.wait()})"
            read += len(chunk)
            buf += chunk

    def interrupt(self) -> None:
        """Interrupt the running cell (the kernel's timeout signal): it answers as timed out."""
        if self.kernel and _start_time(self.kernel) == self.kernel_start:
            try:
                os.kill(self.kernel, signal.SIGALRM)
            except OSError:
                pass

    def close(self) -> None:
        """Kill everything the context started, then its supervisor and kernel."""
        if self.closed:
            return
        self.closed = True
        if self.proc.poll() is None:
            _kill_descendants(self.proc.pid)
        if self.kernel and _start_time(self.kernel) == self.kernel_start:  # orphaned: its supervisor died
            _kill_descendants(self.kernel)
            try:
                os.kill(self.kernel, signal.SIGKILL)
            except OSError:
                pass
        _kill_tree(self.proc.pid)  # its session too, as before (a process the walk raced past)
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()
        _disown(self.proc)
        self.chan.close()


CONTEXTS: dict[str, CodeContext] = {}


def op_repl(sock: Conn, req: dict[str, Any]) -> None:
    """Open, run in, close or list code contexts; a run's reply line goes back as DATA frames."""
    op, cid = req["op"], str(req.get("id", ""))
    if op == "repl_list":
        listed = [{"id": k, "created": c.created, "cells": c.cells} for k, c in sorted(CONTEXTS.items())]
        sock.sendall(pack_json({"ok": True, "contexts": listed}))
        return
    if op == "repl_open":
        if len(CONTEXTS) >= int(req["max_contexts"]):
            raise Refused(f"the sandbox has {len(CONTEXTS)} code contexts: close one first", "EMLINK")
        started = CodeContext(req["caps"])
        why = started.start(time.monotonic() + float(req["start_seconds"]))
        if why:
            started.close()
            raise Refused(f"the code context's python3 did not start: it {why}", "ENOEXEC")
        CONTEXTS[cid] = started
        sock.sendall(pack_json({"ok": True}))
        return
    ctx = CONTEXTS.get(cid)
    if ctx is None:
        raise Refused(f"code context {cid} not found", "ENOENT")
    if op == "repl_close":
        CONTEXTS.pop(cid, None)
        ctx.close()
        sock.sendall(pack_json({"ok": True}))
        return
    wait = float(req["wait_seconds"])
    if not ctx.lock.acquire(timeout=wait):
        raise Refused("the code context is busy with another run: retry when it ends", "EBUSY")
    try:
        ctx.cells += 1
        token = _token()
        line, why = b"", f"exited (code {ctx.proc.poll()})"
        deadline = time.monotonic() + wait
        if ctx.send(dict(req["request"], token=token)):
            try:
                line, why = ctx.reply(deadline, int(req["max_reply_bytes"]), token, hangup=sock)
            except ClientLeft:  # nobody waits for this run: interrupt it; the context goes on
                ctx.interrupt()
                grace = min(deadline, time.monotonic() + INTERRUPT_GRACE_SECONDS)
                if not ctx.reply(grace, int(req["max_reply_bytes"]), token)[0]:
                    CONTEXTS.pop(cid, None)
                    ctx.close()
                return
        if not line:  # ended, hung past its own timeout, or flooded its reply: the context is gone
            CONTEXTS.pop(cid, None)
            ctx.close()
            code = "ETIME" if why.startswith("did not answer") else "ESRCH"
            raise Refused(f"the code context's python process {why}: its state is lost", code)
        FrameWriter(sock).write(line)
    finally:
        ctx.lock.release()
    sock.sendall(pack_json({"ok": True}))


OPS = {
    "exec": op_exec,
    "tar_out": op_tar_out,
    "tar_in": op_tar_in,
    **{op: op_repl for op in ("repl_open", "repl_run", "repl_close", "repl_list")},
}


class Conn:
    """An accepted connection. Frames go out whole under a lock the heartbeat shares, so a BEAT
    never lands inside another frame; the operations use it like the socket it wraps."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()

    def sendall(self, data: bytes) -> None:
        with self.lock:
            self.sock.sendall(data)

    def recv(self, n: int) -> bytes:
        return self.sock.recv(n)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    def beat(self) -> None:
        """One heartbeat, never blocking: skipped when a frame is being sent (that is news
        enough) or the socket's buffer is full (the server is not reading: it is not waiting)."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            sent = self.sock.send(BEAT_FRAME, socket.MSG_DONTWAIT)
            if sent < len(BEAT_FRAME):  # a 5-byte send is not split in practice; finish it if it was
                self.sock.sendall(BEAT_FRAME[sent:])
        except OSError:
            pass
        finally:
            self.lock.release()


class Heartbeat:
    """One thread beating on every connection being handled (not one thread per connection:
    the sandbox's pids limit counts threads)."""

    def __init__(self) -> None:
        self.conns: set[Conn] = set()
        self.lock = threading.Lock()

    def add(self, conn: Conn) -> None:
        with self.lock:
            self.conns.add(conn)

    def discard(self, conn: Conn) -> None:
        with self.lock:
            self.conns.discard(conn)

    def run(self) -> None:
        while True:
            time.sleep(HEARTBEAT_SECONDS)
            with self.lock:
                conns = list(self.conns)
            for conn in conns:
                conn.beat()


HEARTBEAT = Heartbeat()


def handle(sock: socket.socket, listener: Listener | None = None) -> None:
    conn = Conn(sock)
    HEARTBEAT.add(conn)
    try:
        _kind, payload = recv_frame(conn)
        req = json.loads(payload)
        if req.get("op") == "ping":
            conn.sendall(pack_json({"ok": True, "pid": os.getpid()}))
        elif req.get("op") == "quiesce" and listener is not None:
            listener.quiesce(conn)
        elif req.get("op") in OPS:
            OPS[req["op"]](conn, req)
        else:
            op_fs(conn, req)
    except Refused as exc:
        try:
            conn.sendall(pack_json({"error": str(exc), "errno": exc.code}))
        except OSError:
            pass
    except RecursionError:  # a path or tree deeper than the agent walks (a job can make one)
        try:
            reply = {"error": "path or tree too deep for this operation", "errno": "ELOOP"}
            conn.sendall(pack_json(reply))
        except OSError:
            pass
    except (EOFError, OSError, ValueError):
        pass
    except Exception as exc:  # noqa: BLE001  one bad request must not take the agent down
        try:
            conn.sendall(pack_json({"error": f"agent error: {type(exc).__name__}: {exc}"}))
        except OSError:
            pass
    finally:
        HEARTBEAT.discard(conn)
        conn.close()


def _setup(limits: dict[str, Any]) -> None:
    """Prepare the sandbox's root before the first request is accepted."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: jobs cannot ptrace the agent
    except (OSError, AttributeError):
        pass
    import resource

    nofile = int(limits.get("nofile") or 0)
    if nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    as_bytes = int(limits.get("as_bytes") or 0)
    if as_bytes:  # no memory cgroup: a per-process address-space cap is the best left
        resource.setrlimit(resource.RLIMIT_AS, (as_bytes, as_bytes))
    nproc = int(limits.get("nproc") or 0)
    if nproc:  # no pids cgroup: counted per user namespace, so per sandbox
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    _copy_tree("/.pandastack/etc", "/etc")
    if os.path.isdir("/.pandastack-rootfs"):
        _copy_tree("/.pandastack-rootfs", "/")


def _copy_tree(src: str, dst: str) -> None:
    import shutil

    for root, dirs, files in os.walk(src):
        rel = os.path.relpath(root, src)
        target = dst if rel == "." else os.path.join(dst, rel)
        os.makedirs(target, exist_ok=True)
        for d in dirs:
            s = os.path.join(root, d)
            if os.path.islink(s):
                os.symlink(os.readlink(s), os.path.join(target, d))
        for f in files:
            s = os.path.join(root, f)
            if os.path.islink(s):
                os.symlink(os.readlink(s), os.path.join(target, f))
            else:
                shutil.copy2(s, os.path.join(target, f))


# Under gVisor the directory of the agent's listening socket (set by main): never deleted.
SOCKET_DIR = ""


def _read_some(fd: int) -> None:
    """One read of what a non-blocking pipe holds (a bounded drain: a writer may never stop)."""
    try:
        os.read(fd, CHUNK)
    except BlockingIOError:
        pass


def _dac_override(raised: bool) -> None:
    """Raise (or drop) CAP_DAC_OVERRIDE in this thread's effective set where it is permitted
    (gVisor gives the agent that one, for its socket dir; no process it starts can have it)."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [
            ("effective", ctypes.c_uint32),
            ("permitted", ctypes.c_uint32),
            ("inheritable", ctypes.c_uint32),
        ]

    try:
        libc = ctypes.CDLL(None)
        header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
        if libc.capget(ctypes.byref(header), data) != 0:
            return
        bit = 1 << 1  # CAP_DAC_OVERRIDE
        data[0].effective = (
            (data[0].effective | bit) & data[0].permitted if raised else data[0].effective & ~bit
        )
        libc.capset(ctypes.byref(header), data)
    except (OSError, AttributeError):
        pass


class Listener:
    """The agent's listening socket and its accept loop.

    bwrap hands the agent a listening fd. Under gVisor the agent binds a path in a directory
    bound from the host (``runsc --host-uds=create``) and can give it up for a checkpoint: a
    host socket open in the sandbox would make the image unrestorable (see ``quiesce``). The
    server says when to listen again through the agent's stdin, a pipe only the server writes
    (runsc hands a restored sandbox the new stdin), never through a path in that directory;
    after each bind the agent says so on its stdout, a pipe only the server reads, and the
    server links the new socket into a directory of its own (nothing it connects to is a name
    the guest can change).
    """

    def __init__(self, spec: str) -> None:
        self.path = "" if spec.isdigit() else spec
        # The server's go-ahead after a checkpoint, and "listening" back to it (dups: main points
        # fds 0 and 1 at /dev/null).
        self.resume_fd = os.dup(0) if self.path else -1
        self.listening_fd = os.dup(1) if self.path else -1
        if self.path:  # a full pipe (a job can fill it too) must not hold the agent: the server
            os.set_blocking(self.listening_fd, False)  # reads it whenever it waits for a bind
        self.sock = socket.socket(fileno=int(spec)) if not self.path else self._bind()
        self.sock.set_inheritable(False)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        self.quiescing = threading.Event()
        self.closed = threading.Event()
        self.lock = threading.Lock()
        self.open_conns = 0

    def _bind(self) -> socket.socket:
        # The socket dir is not root's (no job may write it): bind with the one capability the
        # agent holds, raised in this thread for the bind alone.
        _dac_override(True)
        try:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(self.path)
            os.chmod(self.path, 0o600)  # the server's alone (its directory is 0700 as well)
        finally:
            _dac_override(False)
        sock.listen(128)
        try:
            os.write(self.listening_fd, b"L")
        except OSError:  # full (what is in it wakes the server just as well), or the server has gone
            pass
        return sock

    def serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ)
        sel.register(self.wake_r, selectors.EVENT_READ)
        while True:
            ready = {key.fd for key, _ in sel.select()}
            if self.quiescing.is_set():
                sel.unregister(self.sock)
                self.sock.close()
                self._drain_resume()  # a go-ahead from before this quiesce does not count
                self.closed.set()
                self._await_resume()
                self.sock = self._bind()
                sel.register(self.sock, selectors.EVENT_READ)
                continue
            if self.wake_r in ready:  # a stray wake-up: under gVisor a job can write this pipe
                _read_some(self.wake_r)
            if self.sock.fileno() not in ready:
                continue  # (never block in accept: a quiesce must be seen at once)
            try:
                conn, _ = self.sock.accept()
            except OSError:  # EMFILE and the like: the agent must outlive a burst of requests
                time.sleep(0.05)
                continue
            with self.lock:
                self.open_conns += 1
            try:
                threading.Thread(target=self._handle, args=(conn,), daemon=True).start()
            except RuntimeError:  # no thread to be had (the sandbox's pids limit): refuse this one
                self._done()
                conn.close()

    def _handle(self, conn: socket.socket) -> None:
        try:
            handle(conn, self)
        finally:
            self._done()

    def _done(self) -> None:
        with self.lock:
            self.open_conns -= 1

    def _drain_resume(self) -> None:
        if select.select([self.resume_fd], [], [], 0)[0] and not os.read(self.resume_fd, CHUNK):
            os._exit(0)  # the server closed it: it has gone, and so does the sandbox

    def _await_resume(self) -> None:
        """Wait for the server's go-ahead (a byte on the resume pipe) before listening again: in
        the checkpointed parent once its image is written, in a restored child at once."""
        if not os.read(self.resume_fd, 64):
            os._exit(0)
        _read_some(self.wake_r)  # once: what a job writes there must not keep the agent here
        self.quiescing.clear()

    def quiesce(self, conn: Conn) -> None:
        """Close the listener and let every other connection finish, then say so: the server
        closes this last connection and checkpoints a sandbox with no host socket open."""
        if not self.path:
            conn.sendall(pack_json({"error": "quiesce needs a listening path (the gVisor backend)"}))
            return
        self.quiescing.set()
        os.write(self.wake_w, b"q")
        if not self.closed.wait(QUIESCE_WAIT_SECONDS):  # (a job can read the wake pipe dry)
            self.quiescing.clear()
            conn.sendall(pack_json({"error": "the agent did not close its listener", "errno": "EBUSY"}))
            return
        deadline = time.monotonic() + QUIESCE_WAIT_SECONDS
        while time.monotonic() < deadline:
            with self.lock:
                if self.open_conns <= 1:
                    conn.sendall(pack_json({"ok": True}))
                    return
            time.sleep(0.005)
        conn.sendall(pack_json({"error": "sandbox busy: a request is still running", "errno": "EBUSY"}))


def _watch_lifeline(fd: int) -> None:
    """The server holds this pipe's other end: at its end of file (the sandbox deleted, or the server
    gone, even mid-start) the agent exits, and the sandbox's init and every process with it."""
    try:
        while os.read(fd, 64):
            pass
    except OSError:
        pass
    os._exit(0)


# The agent's threads (one per request, the heartbeat, the reaper) reserve this much stack each
# instead of 8 MiB: without a memory cgroup the sandbox's cap is RLIMIT_AS, address space, which
# the agent shares with its jobs (a 20,000-entry listing was a MemoryError under 256 MB there).
AGENT_THREAD_STACK_BYTES = 1024 * 1024


def main() -> None:
    threading.stack_size(AGENT_THREAD_STACK_BYTES)
    # As PID 1 the kernel drops every signal from inside the sandbox the agent has no handler for:
    # Python's SIGINT handler would let a job's `kill -INT 1` end the sandbox.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    limits = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    lifeline = limits.get("lifeline")
    if isinstance(lifeline, int):
        os.set_inheritable(lifeline, False)  # the jobs get no copy
        threading.Thread(target=_watch_lifeline, args=(lifeline,), daemon=True).start()
    _setup(limits)
    threading.Thread(target=reap_orphans, name="reaper", daemon=True).start()
    GUEST_ENV.update(os.environ)  # the template's environment (bwrap --clearenv, then --setenv)
    listener = Listener(sys.argv[1])
    global SOCKET_DIR
    SOCKET_DIR = os.path.dirname(os.path.realpath(listener.path)) if listener.path else ""
    devnull = os.open("/dev/null", os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)  # (gVisor: the listener keeps the server's pipes, see Listener)
    os.chdir("/")  # /proc/self/cwd of the agent names the root (the delete guard resolves it)
    threading.Thread(target=HEARTBEAT.run, name="heartbeat", daemon=True).start()
    listener.serve()


if __name__ == "__main__":
    main()
