"""The isolation boundary behind one small interface: bwrap (default) or gVisor.

The manager owns sandboxes, the pool, TTLs and the wire; a backend only starts,
kills and (where it can) memory-forks the processes behind one sandbox. Both run
the same agent (guest/agent.py), so the exec, file and timeout logic is shared.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

from pandastack_local.isolation.cgroups import Cgroups
from pandastack_local.isolation.process import SandboxProcess
from pandastack_local.templates.registry import Template

log = logging.getLogger("pandastack_local")

ISOLATIONS = ("bwrap", "gvisor")
DEFAULT_ISOLATION = "bwrap"


class IsolationBackend(Protocol):
    name: str
    # True: fork() copies the parent's memory (checkpoint + restore); False: the manager's cold fork.
    memory_fork: bool

    def socket_path(self, sandboxes_dir: Path, name: str) -> Path: ...

    def start(self, guest_dir: Path, templates: list[Template]) -> None: ...

    def describe(self) -> str: ...

    def expose_built(self, path: Path) -> None: ...

    def spawn(self, name: str, template: Template, sandboxes_dir: Path) -> SandboxProcess: ...

    def kill(self, sp: SandboxProcess) -> None: ...

    def reap_leftovers(self, sandboxes_dir: Path) -> list[str]: ...

    def close(self) -> None: ...


def make_backend(isolation_name: str, cgroups: Cgroups, instance: str, runsc: str | None) -> IsolationBackend:
    """The backend named ``isolation_name``; gVisor refuses at once when runsc is not usable."""
    if isolation_name == "bwrap":
        from pandastack_local.isolation.bwrap.backend import BwrapBackend

        return BwrapBackend(cgroups, instance)
    if isolation_name == "gvisor":
        from pandastack_local.isolation.gvisor.backend import GvisorBackend

        return GvisorBackend(cgroups, runsc, instance)
    raise ValueError(f"isolation must be one of {', '.join(ISOLATIONS)}, not {isolation_name!r}")
