"""The server's private mount namespace: read-only device nodes, and the host directories
the sandboxes need exposed to their unprivileged uids.

The server runs in its own mount namespace where the host's ``/dev/null``,
``/dev/zero``, ... are read-only bind mounts.

bwrap's ``--dev`` binds those nodes into each sandbox, and a bind copies the
source mount's flags: the sandbox can still read and write the devices (a
device's data does not go through the mount), but chmod, chown and touch on
them fail with EROFS, so no sandbox can change the host's inode (crossing 1 of
issue 12). bwrap itself cannot make a read-only device bind (its read-only
binds add ``nodev``), hence this one step before the server starts.

A root server unshares a mount namespace; a non-root server first unshares a
user namespace in which it is root (its uid and gid mapped to themselves' 0),
which is what lets it mount there. Either way the mounts exist only in the
server's namespace and vanish with it; host mounts still propagate in.

bwrap runs as each sandbox's unprivileged host uid, which may not walk the
server's private directories (a 0700 state dir, a venv under /root, a template
in a 0700 temp dir). ``Exposed`` binds each directory a sandbox needs (the
guest files, template rootfs dirs, bwrap itself) under one world-traversable
directory, in this namespace only: the sandbox's uid reaches exactly those.

A bind mount shows its source's path in the sandbox's ``/proc/self/mountinfo``
(the path inside the source file system, whatever name the bind has here). So
what is small is not bound but copied (``Exposed.copy``) onto a tmpfs of its
own, whose mountinfo line says ``/``: the guest files, which live in the state
dir (by default under the server user's home).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import tempfile
from pathlib import Path

DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_NOATIME, MS_NODIRATIME = 0x20, 0x1000, 0x400, 0x800
MS_REC, MS_SLAVE, MS_RELATIME = 0x4000, 0x80000, 0x200000
# statvfs f_flag bit -> the mount flag that keeps it (locked flags must be kept on a remount).
_KEEP = {
    os.ST_NOSUID: MS_NOSUID,
    os.ST_NODEV: MS_NODEV,
    os.ST_NOEXEC: MS_NOEXEC,
    os.ST_NOATIME: MS_NOATIME,
    os.ST_NODIRATIME: MS_NODIRATIME,
    os.ST_RELATIME: MS_RELATIME,
}


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(res: int, what: str) -> None:
    if res != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _enter_namespace(libc: ctypes.CDLL) -> None:
    if os.geteuid() == 0:
        _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        return
    uid, gid = os.geteuid(), os.getegid()
    _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare(CLONE_NEWUSER|CLONE_NEWNS)")
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
    Path("/proc/self/gid_map").write_text(f"0 {gid} 1")


_private = False
MNT_DETACH = 0x2


def private() -> bool:
    """True once this process runs in its own mount namespace (protect_device_nodes succeeded)."""
    return _private


def protect_device_nodes() -> list[str]:
    """Make the device nodes read-only binds in a new mount namespace of this process.

    Must run before the process starts any thread (unshare refuses a mount
    namespace to a multi-threaded process). Returns the protected paths;
    raises OSError when the kernel refuses (the caller logs that the wall is missing).
    """
    libc = _libc()
    _enter_namespace(libc)
    # Our mounts stay ours; the host's still reach us.
    _check(libc.mount(None, b"/", None, MS_REC | MS_SLAVE, None), "make / a slave mount")
    global _private
    _private = True
    done = []
    for name in DEVICES:
        path = f"/dev/{name}"
        if not os.path.exists(path):
            continue
        keep = sum(ms for st, ms in _KEEP.items() if os.statvfs(path).f_flag & st)
        _check(libc.mount(path.encode(), path.encode(), None, MS_BIND, None), f"bind {path}")
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | keep
        _check(libc.mount(None, path.encode(), None, flags, None), f"remount {path} read-only")
        done.append(path)
    return done


def device_nodes_read_only() -> bool:
    """True when every existing device node is a read-only mount in this namespace."""
    wanted = {f"/dev/{name}" for name in DEVICES if os.path.exists(f"/dev/{name}")}
    found = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 5 and parts[4] in wanted and "ro" in parts[5].split(","):
                found.add(parts[4])
    return found == wanted


class Exposed:
    """Host directories bound read-only under one world-traversable directory of this namespace."""

    def __init__(self) -> None:
        # /run when we may (root): unlike /tmp, no tmpfiles cleaner removes its old empty dirs, which
        # would detach these binds under a long-running server.
        parent = "/run" if os.access("/run", os.W_OK) else None
        self.root = Path(tempfile.mkdtemp(prefix="pandastack-exposed-", dir=parent))
        self.root.chmod(0o711)
        self.mounts: list[Path] = []

    def expose(self, source: Path, name: str, writable: bool = False) -> Path:
        """Bind ``source`` at ``name`` under the root: read-only and nosuid, or ``writable`` and
        nosuid, nodev, noexec."""
        target = self.root / name
        target.mkdir(mode=0o755)
        libc = _libc()
        _check(libc.mount(str(source).encode(), str(target).encode(), None, MS_BIND, None), f"bind {source}")
        self.mounts.append(target)
        keep = sum(ms for st, ms in _KEEP.items() if os.statvfs(target).f_flag & st)
        flags = MS_REMOUNT | MS_BIND | MS_NOSUID | keep
        flags |= (MS_NODEV | MS_NOEXEC) if writable else MS_RDONLY
        what = "writable" if writable else "read-only"
        _check(libc.mount(None, str(target).encode(), None, flags, None), f"remount {target} {what}")
        return target

    def conceal(self, target: Path) -> None:
        """Undo one ``expose``."""
        if target in self.mounts:
            self.mounts.remove(target)
            _libc().umount2(str(target).encode(), MNT_DETACH)
            with contextlib.suppress(OSError):
                target.rmdir()

    def copy(self, source: Path, name: str, size_mb: int = 64) -> Path:
        """A read-only copy of the tree ``source`` on a tmpfs of its own (see the module docstring)."""
        target = self.root / name
        target.mkdir(mode=0o755)
        libc = _libc()
        options = f"size={size_mb}m,mode=755".encode()
        _check(libc.mount(b"tmpfs", str(target).encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options), "tmpfs")
        self.mounts.append(target)
        shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
        flags = MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
        _check(libc.mount(None, str(target).encode(), None, flags, options), f"remount {target} read-only")
        return target

    def close(self) -> None:
        libc = _libc()
        for target in reversed(self.mounts):
            libc.umount2(str(target).encode(), MNT_DETACH)
            with contextlib.suppress(OSError):
                target.rmdir()
        self.mounts.clear()
        with contextlib.suppress(OSError):
            self.root.rmdir()
