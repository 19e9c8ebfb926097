"""Per-sandbox cgroups: the hard memory, pids and CPU walls, plus freeze and kill.

Namespaces hide things; only cgroups bound what a job may consume. This module
finds what the host offers (cgroup v1 hierarchies, the v2 unified tree, or
nothing writable), creates one cgroup per sandbox under a per-server base, and
says clearly which limits it could not apply so the server can log it once.

Socket buffers: cgroup v2 charges them to ``memory.max`` with everything else.
cgroup v1 charges TCP and UDP buffers to a counter of their own,
``memory.kmem.tcp``, and only once it has a limit (without one they are charged
to nothing). So on v1 a sandbox's ``memory_mb`` is split: ``socket_budget``
(an eighth) for its socket buffers, the rest for its processes, and the kernel
pushes back on sockets (smaller windows, dropped segments) at half the budget.
Past its limit the kernel still grants each TCP socket one more segment, so
many sockets can pass it: the bwrap backend's socket guard kills the job that
holds more than the whole budget (``socket_bytes`` is what it reads).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from pandastack_local.templates.registry import Template

log = logging.getLogger(__name__)

LIMITS = ("memory", "pids", "cpu", "freezer")
CPU_PERIOD_US = 100000
MIB = 1024 * 1024
# cgroup v1: the part of memory_mb set aside for socket buffers (memory.kmem.tcp), and its floor.
SOCKET_SHARE = 8
MIN_SOCKET_BUDGET = 8 * MIB
V1_TCP_LIMIT = "memory.kmem.tcp.limit_in_bytes"
V1_TCP_USAGE = "memory.kmem.tcp.usage_in_bytes"
# cgroup v2: what each sandbox is protected up to from reclaim (memory.low): what admission counts
# a new sandbox for (admission.START_RESERVE_MB), as Kubernetes' MemoryQoS protects a request.
MEMORY_LOW_BYTES = 32 * MIB


def socket_budget(template: Template) -> int:
    """Bytes of socket buffers a sandbox may hold that no cgroup charges with the rest of its memory."""
    return max(template.memory_mb * MIB // SOCKET_SHARE, MIN_SOCKET_BUDGET)


def cpu_quota_us(cpus: int) -> int:
    """The template's CPUs as a CFS quota, at most 90 % of the host: a sandbox never gets every CPU."""
    host = (os.cpu_count() or 1) * CPU_PERIOD_US
    return min(cpus * CPU_PERIOD_US, host * 9 // 10)


def _read_mountinfo() -> list[tuple[str, str, str, str]]:
    """(mount root, mount point, fstype, super options) of every mount."""
    out = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            parts, rparts = left.split(), right.split()
            if len(parts) >= 5 and len(rparts) >= 3:
                out.append((parts[3], parts[4], rparts[0], rparts[2]))
    return out


def _own_cgroups() -> dict[str, str]:
    """Controller (or '' for v2) -> this process's cgroup path."""
    out: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            for c in ctrls.split(",") if ctrls else [""]:
                out[c] = path
    return out


def _join(mount: str, root: str, own: str) -> Path:
    rel = own[len(root) :] if root != "/" and own.startswith(root) else own
    return Path(mount + rel.rstrip("/"))


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
        return True
    except OSError:
        return False


def _rmdir_tree(path: Path) -> None:
    if not path.is_dir():
        return
    for child in sorted((p for p in path.iterdir() if p.is_dir()), reverse=True):
        _rmdir_tree(child)
    for attempt in range(200):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            _kill_procs(path)
            time.sleep(0.002 if attempt < 50 else 0.02)


def _kill_procs(path: Path) -> None:
    try:
        pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


@dataclass
class Cgroups:
    """The cgroup bases this server owns; ``version`` is 'v1', 'v2' or 'none'."""

    instance: str
    version: str = "none"
    bases: dict[str, Path] = field(default_factory=dict)  # limit name -> base dir
    missing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # v1 only: the kernel has memory.kmem.tcp, so sandboxes' TCP and UDP buffers can be charged.
    tcp_accounting: bool = False

    @classmethod
    def detect(cls, instance: str) -> Cgroups:
        cg = cls(instance=instance)
        mounts = _read_mountinfo()
        own = _own_cgroups()
        base_name = f"pandastack-local-{instance}"
        v1 = {}
        v2_mount = None
        for root, point, fstype, opts in mounts:
            if fstype == "cgroup":
                for c in opts.split(","):
                    if c in LIMITS and c in own:
                        v1[c] = _join(point, root, own[c]) / base_name
            elif fstype == "cgroup2" and Path(point, "cgroup.controllers").exists():
                ctrls = Path(point, "cgroup.controllers").read_text().split()
                if ctrls and v2_mount is None:
                    v2_mount = (root, point)
        if v1:
            cg.version = "v1"
            for limit, base in v1.items():
                try:
                    base.mkdir(exist_ok=True)
                    cg.bases[limit] = base
                except OSError as exc:
                    cg.notes.append(f"{limit}: cannot create {base}: {exc.strerror}")
            if "memory" in cg.bases:
                cg.tcp_accounting = (cg.bases["memory"] / V1_TCP_LIMIT).exists()
                if not cg.tcp_accounting:
                    cg.notes.append(
                        f"memory: no {V1_TCP_LIMIT} on this kernel: sandboxes' TCP and UDP buffers are "
                        "charged to no cgroup"
                    )
        elif v2_mount is not None:
            cg.version = "v2"
            cg._setup_v2(v2_mount[1], v2_mount[0], own.get("", "/"), base_name)
        cg.missing = [lim for lim in LIMITS if lim not in cg.bases]
        return cg

    def _setup_v2(self, mount: str, root: str, own: str, base_name: str) -> None:
        """Root: a base under the v2 root. Otherwise a delegated subtree of our own cgroup."""
        mount_root = Path(mount)
        candidates: list[tuple[Path, Path | None]] = [(mount_root, None)]
        own_dir = _join(mount, root, own)
        if own_dir != mount_root:
            candidates.append((own_dir, own_dir / "pandastack-server"))
        for parent, leaf in candidates:
            try:
                if leaf is not None:
                    # v2 forbids processes in a cgroup that distributes controllers: move us to a leaf.
                    leaf.mkdir(exist_ok=True)
                    (leaf / "cgroup.procs").write_text(str(os.getpid()))
                base = parent / base_name
                base.mkdir(exist_ok=True)
            except OSError as exc:
                self.notes.append(f"v2: cannot use {parent}: {exc.strerror}")
                continue
            available = (parent / "cgroup.controllers").read_text().split()
            enabled = []
            for ctrl in ("memory", "pids", "cpu"):
                if ctrl in available and _write(parent / "cgroup.subtree_control", f"+{ctrl}"):
                    if _write(base / "cgroup.subtree_control", f"+{ctrl}"):
                        enabled.append(ctrl)
            if "memory" in enabled:
                # A child's memory.low protects only as far as its parent's does: pass it all down.
                _write(base / "memory.low", "max")
            for ctrl in enabled:
                self.bases[ctrl] = base
            if (base / "cgroup.freeze").exists() or enabled:
                self.bases["freezer"] = base
            if enabled:
                return
        return

    def summary(self) -> str:
        active = ", ".join(sorted(self.bases)) or "none"
        text = f"cgroup {self.version}: active limits: {active}"
        if self.missing:
            text += f"; NOT applied: {', '.join(self.missing)}"
        return text

    def dirs(self, name: str) -> list[Path]:
        return sorted({base / name for base in self.bases.values()})

    def memory_limit_bytes(self, template: Template) -> int:
        """The sandbox's memory cgroup limit: ``memory_mb``, less its socket budget on v1 (there
        TCP and UDP buffers are charged apart, to ``memory.kmem.tcp``)."""
        mem = template.memory_mb * MIB
        if self.version == "v1" and self.tcp_accounting:
            mem -= socket_budget(template)
        return mem

    def create(self, name: str, template: Template) -> list[Path]:
        """Make the sandbox's cgroup(s) with limits set; return the cgroup.procs files to join."""
        mem = self.memory_limit_bytes(template)
        for d in self.dirs(name):
            d.mkdir(exist_ok=True)
        if self.version == "v1":
            if "memory" in self.bases:
                d = self.bases["memory"] / name
                sockets = socket_budget(template) if self.tcp_accounting else 0
                _write(d / "memory.swappiness", "0")
                _write(d / "memory.limit_in_bytes", str(mem))
                _write(d / "memory.memsw.limit_in_bytes", str(mem))
                if sockets:
                    _write(d / V1_TCP_LIMIT, str(sockets // 2))
            if "pids" in self.bases:
                _write(self.bases["pids"] / name / "pids.max", str(template.pids_max))
            if "cpu" in self.bases:
                d = self.bases["cpu"] / name
                _write(d / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(d / "cpu.cfs_quota_us", str(cpu_quota_us(template.cpu)))
                _write(d / "cpu.shares", str(1024 * template.cpu))
        elif self.version == "v2":
            if "memory" in self.bases:
                d = self.bases["memory"] / name
                _write(d / "memory.max", str(mem))
                _write(d / "memory.swap.max", "0")
                _write(d / "memory.low", str(min(MEMORY_LOW_BYTES, mem)))
            if "pids" in self.bases:
                _write(self.bases["pids"] / name / "pids.max", str(template.pids_max))
            if "cpu" in self.bases:
                d = self.bases["cpu"] / name
                _write(d / "cpu.max", f"{cpu_quota_us(template.cpu)} {CPU_PERIOD_US}")
                _write(d / "cpu.weight", str(min(10000, 100 * template.cpu)))
        return [d / "cgroup.procs" for d in self.dirs(name)]

    def pids(self, name: str) -> list[int]:
        for d in self.dirs(name):
            with contextlib.suppress(OSError, ValueError):
                return [int(p) for p in (d / "cgroup.procs").read_text().split()]
        return []

    def freeze(self, name: str, frozen: bool) -> bool:
        """Freeze or thaw; False when no freezer is available (caller falls back to signals)."""
        base = self.bases.get("freezer")
        if base is None:
            return False
        if self.version == "v1":
            return _write(base / name / "freezer.state", "FROZEN" if frozen else "THAWED")
        return _write(base / name / "cgroup.freeze", "1" if frozen else "0")

    def socket_bytes(self, name: str) -> int | None:
        """The sandbox's TCP and UDP buffers when they are charged apart from its memory (cgroup
        v1's memory.kmem.tcp), forced charges past the limit included; None elsewhere."""
        if not self.tcp_accounting:
            return None
        try:
            return int((self.bases["memory"] / name / V1_TCP_USAGE).read_text())
        except (OSError, ValueError):
            return None

    def oom_kills(self, name: str) -> int:
        base = self.bases.get("memory")
        if base is None:
            return 0
        fname = "memory.oom_control" if self.version == "v1" else "memory.events"
        with contextlib.suppress(OSError, ValueError):
            for line in (base / name / fname).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def memory_usage(self, name: str) -> int | None:
        """Bytes the sandbox's memory cgroup is charged now (processes, tmpfs files, page cache)."""
        base = self.bases.get("memory")
        if base is None:
            return None
        fname = "memory.usage_in_bytes" if self.version == "v1" else "memory.current"
        with contextlib.suppress(OSError, ValueError):
            return int((base / name / fname).read_text())
        return None

    def charged(self, name: str) -> int | None:
        """All the sandbox's memory a cgroup charges: its memory cgroup, plus on v1 its TCP and
        UDP buffers (charged apart, to memory.kmem.tcp)."""
        usage = self.memory_usage(name)
        if usage is None:
            return None
        return usage + (self.socket_bytes(name) or 0)

    def working_set(self, name: str) -> int | None:
        """What the sandbox holds that the kernel cannot simply drop: its charge (``charged``)
        less its inactive file cache (Kubernetes' working set; tmpfs and /dev/shm pages are not
        file cache, so they count)."""
        usage = self.charged(name)
        if usage is None:
            return None
        key = "total_inactive_file" if self.version == "v1" else "inactive_file"
        with contextlib.suppress(OSError, ValueError):
            for line in (self.bases["memory"] / name / "memory.stat").read_text().splitlines():
                field_name, _, value = line.partition(" ")
                if field_name == key:
                    return max(usage - int(value), 0)
        return usage

    def set_memory_limit(self, name: str, limit_bytes: int) -> bool:
        """Change a live sandbox's memory limit (the pressure guard's squeeze and its lift)."""
        base = self.bases.get("memory")
        if base is None:
            return False
        d = base / name
        if self.version == "v2":
            return _write(d / "memory.max", str(limit_bytes))
        # v1 keeps memsw >= mem: raise memsw first when growing, lower it last when shrinking.
        mem, memsw = d / "memory.limit_in_bytes", d / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            try:
                current = int((d / "memory.limit_in_bytes").read_text())
            except (OSError, ValueError):
                return False
            if limit_bytes >= current:
                return _write(memsw, str(limit_bytes)) and _write(mem, str(limit_bytes))
            return _write(mem, str(limit_bytes)) and _write(memsw, str(limit_bytes))
        return _write(mem, str(limit_bytes))

    def kill(self, name: str) -> None:
        """SIGKILL every process in the sandbox's cgroups (a frozen one too); the cgroups stay."""
        self.freeze(name, False)
        for d in self.dirs(name):
            if self.version == "v2":
                _write(d / "cgroup.kill", "1")
            _kill_procs(d)

    def remove(self, name: str) -> None:
        """Kill whatever is left in the sandbox's cgroups and remove them."""
        self.kill(name)
        for d in self.dirs(name):
            _rmdir_tree(d)

    def remove_bases(self) -> None:
        """Shutdown: remove this server's (now empty) per-instance base cgroups."""
        for base in set(self.bases.values()):
            with contextlib.suppress(OSError):
                base.rmdir()

    def reap_all(self) -> list[str]:
        """Remove every sandbox cgroup a previous run of this server left behind."""
        names: set[str] = set()
        for base in set(self.bases.values()):
            with contextlib.suppress(OSError):
                names.update(p.name for p in base.iterdir() if p.is_dir())
        for name in names:
            self.remove(name)
        return sorted(names)
