"""The in-sandbox agent, and the frame protocol the server speaks with it.

This file runs in two places. Inside each sandbox it is the long-lived process
that bwrap starts (``/usr/bin/python3 -I -S /.pandastack/agent.py FD LIMITS``):
because it lives in the sandbox's namespaces, every exec and every file path it
touches resolves inside the sandbox and nowhere else. On the host the server
imports it only for the frame helpers, so it must stay stdlib-only and must not
import anything from ``pandastack_local``.

Protocol: one unix-socket connection per operation. Every message is a frame:
``kind`` (1 byte) + ``length`` (4 bytes, big endian) + payload. The request is a
JSON frame, optionally followed by DATA frames and an END frame; the reply is
zero or more STDOUT/STDERR/DATA frames and one final JSON frame.
"""

from __future__ import annotations

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
from typing import Any

JSON, STDOUT, STDERR, DATA, END = 0, 1, 2, 3, 4
_HEADER = struct.Struct("!BI")
MAX_FRAME = 1 << 20
CHUNK = 64 * 1024
# The most a file read sends (the server asks for its own cap; this is the fallback).
MAX_READ_BYTES = 32 * 1024 * 1024
# errno names for refusals that are the file's fault, not the agent's (the server maps them to 4xx).
NOT_REGULAR = "EFTYPE"
TOO_BIG = "EFBIG"
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


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("peer closed")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    kind, length = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if length > MAX_FRAME:
        raise ValueError("frame too large")
    return kind, _recv_exact(sock, length) if length else b""


class FrameReader:
    """File-like reader over DATA frames, ending at an END frame (for tarfile)."""

    def __init__(self, sock: socket.socket) -> None:
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

    def __init__(self, sock: socket.socket) -> None:
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


def _session_pids(sid: int) -> list[int]:
    """Every process of this sandbox in session ``sid`` (the exec's tree)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rfind(b")") + 2 :].split()
        if len(fields) > 3 and int(fields[3]) == sid:
            pids.append(int(name))
    return pids


def _kill_tree(sid: int) -> None:
    for _ in range(3):
        pids = _session_pids(sid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)


class ClientGone(Exception):
    """The server closed the exec's connection: its client went away."""


def op_exec(sock: socket.socket, req: dict[str, Any]) -> None:
    timeout = float(req.get("timeout_seconds") or 0)
    try:
        proc = subprocess.Popen(
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


def _fs_error(op: str, path: str, exc: OSError) -> dict[str, Any]:
    return {"error": f"{op} {path}: {exc.strerror}", "errno": errno.errorcode.get(exc.errno or 0, "")}


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


def read_capped(sock: socket.socket, path: str, cap: int) -> None:
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


def op_fs(sock: socket.socket, req: dict[str, Any]) -> None:
    op, path = req["op"], req["path"]
    try:
        if op == "read":
            read_capped(sock, path, min(int(req.get("max_bytes") or MAX_READ_BYTES), MAX_READ_BYTES))
            sock.sendall(pack_json({"ok": True}))
        elif op == "write":
            reader = FrameReader(sock)
            try:
                parent = os.path.dirname(path)
                if parent:
                    os.makedirs(parent, exist_ok=True)
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
            entries = []
            with os.scandir(path) as it:
                for e in it:  # not followed, like the real server's find -printf %y: a link is "l"
                    entries.append(_entry(e.name, e.stat(follow_symlinks=False)))
            entries.sort(key=lambda e: e["name"])
            sock.sendall(pack_json({"ok": True, "entries": entries}))
        elif op == "delete":
            _remove_all(path)
            sock.sendall(pack_json({"ok": True}))
        else:
            sock.sendall(pack_json({"error": f"unknown fs op {op}"}))
    except Refused as exc:
        sock.sendall(pack_json({"error": f"{op} {path}: {exc}", "errno": exc.code}))
    except OSError as exc:
        sock.sendall(pack_json(_fs_error(op, path, exc)))


def _remove_all(path: str) -> None:
    """Like Go's os.RemoveAll: a missing path is not an error."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        import shutil

        shutil.rmtree(path)
    else:
        os.unlink(path)


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

    def __init__(self, sock: socket.socket, cap: int) -> None:
        super().__init__(sock)
        self.cap = cap
        self.sent = 0

    def write(self, data: bytes) -> int:
        self.sent += len(data)
        if self.sent > self.cap + TAR_OVERHEAD_BYTES:
            raise Refused(f"the parent's files grew past the {self.cap}-byte fork copy cap", TOO_BIG)
        return super().write(data)


def op_tar_out(sock: socket.socket, req: dict[str, Any]) -> None:
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


def op_tar_in(sock: socket.socket, req: dict[str, Any]) -> None:
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


class CodeContext:
    """A code context's Python process (``repl_kernel.py``): a pipe for requests, one for replies."""

    def __init__(self, caps: dict[str, int]) -> None:
        req_r, self.req_w = os.pipe()
        self.rep_r, rep_w = os.pipe()
        self.lock = threading.Lock()
        self.created, self.cells, self.closed, self.pending = time.time(), 0, False, b""
        try:
            self.proc = subprocess.Popen(
                ["python3", "-u", "/.pandastack/repl_kernel.py", json.dumps(caps), str(req_r), str(rep_w)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd="/root",
                env=GUEST_ENV,
                start_new_session=True,
                pass_fds=(req_r, rep_w),
            )
        except OSError as exc:  # no python3 on PATH, no process to be had (pids limit)
            for fd in (self.req_w, self.rep_r):
                os.close(fd)
            raise Refused(f"the code context's python3 could not start: {exc}", "ENOEXEC") from exc
        finally:
            os.close(req_r)
            os.close(rep_w)

    def send(self, request: dict[str, Any]) -> bool:
        """Write one request line; False if the process is gone."""
        data = memoryview(json.dumps(request).encode() + b"\n")
        try:
            while data:
                data = data[os.write(self.req_w, data) :]
        except OSError:
            return False
        return True

    def reply(self, deadline: float, cap: int) -> tuple[bytes, str]:
        """One reply line of at most ``cap`` bytes by ``deadline``, or b"" and why not. What came
        after the line (code in the context can write to the pipe too) waits for the next call."""
        buf = bytearray(self.pending)  # bytearray and a search of each chunk only: linear in the reply
        end = buf.find(b"\n")
        while end < 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return b"", "did not answer in time and was killed"
            if len(buf) > cap:
                return b"", f"sent a reply over the {cap}-byte cap and was killed"
            if not select.select([self.rep_r], [], [], left)[0]:
                continue
            chunk = os.read(self.rep_r, CHUNK)
            if not chunk:
                return b"", f"exited (code {self.proc.wait()})"
            if (found := chunk.find(b"\n")) >= 0:
                end = len(buf) + found
            buf += chunk
        self.pending = bytes(buf[end + 1 :])
        return bytes(buf[: end + 1]), ""

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        _kill_tree(self.proc.pid)
        self.proc.wait()
        for fd in (self.req_w, self.rep_r):
            os.close(fd)


CONTEXTS: dict[str, CodeContext] = {}


def op_repl(sock: socket.socket, req: dict[str, Any]) -> None:
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
        ready, why = started.reply(time.monotonic() + float(req["start_seconds"]), CHUNK)
        if not ready:
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
    with ctx.lock:
        ctx.cells += 1
        line, why = b"", f"exited (code {ctx.proc.poll()})"
        if ctx.send(req["request"]):
            deadline = time.monotonic() + float(req["wait_seconds"])
            line, why = ctx.reply(deadline, int(req["max_reply_bytes"]))
        if not line:  # ended, hung past its own timeout, or flooded its reply: the context is gone
            CONTEXTS.pop(cid, None)
            ctx.close()
            code = "ETIME" if why.startswith("did not answer") else "ESRCH"
            raise Refused(f"the code context's python process {why}: its state is lost", code)
        FrameWriter(sock).write(line)
    sock.sendall(pack_json({"ok": True}))


OPS = {
    "exec": op_exec,
    "tar_out": op_tar_out,
    "tar_in": op_tar_in,
    **{op: op_repl for op in ("repl_open", "repl_run", "repl_close", "repl_list")},
}


def handle(conn: socket.socket, listener: Listener | None = None) -> None:
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
    except (EOFError, OSError, ValueError):
        pass
    except Exception as exc:  # noqa: BLE001  one bad request must not take the agent down
        try:
            conn.sendall(pack_json({"error": f"agent error: {type(exc).__name__}: {exc}"}))
        except OSError:
            pass
    finally:
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

    def quiesce(self, conn: socket.socket) -> None:
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


def main() -> None:
    limits = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    _setup(limits)
    GUEST_ENV.update(os.environ)  # the template's environment (bwrap --clearenv, then --setenv)
    listener = Listener(sys.argv[1])
    devnull = os.open("/dev/null", os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)  # (gVisor: the listener keeps the server's pipes, see Listener)
    listener.serve()


if __name__ == "__main__":
    main()
