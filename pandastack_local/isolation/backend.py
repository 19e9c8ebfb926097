"""The isolation boundary behind one small interface: bwrap (default) or gVisor.

The manager owns sandboxes, the pool, TTLs and the wire; a backend only starts,
kills and (where it can) memory-forks the processes behind one sandbox. Both run
the same agent (guest/agent.py), so the exec, file and timeout logic is shared.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

from pandastack_local.isolation.process import SandboxProcess
from pandastack_local.templates.registry import Template

Ready = Callable[[SandboxProcess], Awaitable[SandboxProcess]]
Kill = Callable[[SandboxProcess], Awaitable[None]]

log = logging.getLogger(__name__)

ISOLATIONS = ("bwrap", "gvisor")
# What a refused ``require_memory`` fork tells the client to do instead.
MEMORY_FORK_FIX = "fork without require_memory for a disk copy, or run the server with --isolation gvisor"
DEFAULT_ISOLATION = "bwrap"


class MemoryForker(Protocol):
    """A backend whose fork copies the parent's memory: checkpoint it, restore each child."""

    name: str

    def prepare_quiesce(self, sp: SandboxProcess) -> None: ...

    def checkpoint(self, sp: SandboxProcess, image: Path, leave_running: bool = True) -> None: ...

    def resume(self, sp: SandboxProcess) -> None: ...

    def restore(self, name: str, template: Template, sandboxes_dir: Path, image: Path) -> SandboxProcess: ...


class BootImageStore(Protocol):
    """Ready sandboxes restored from a booted image per template (gvisor/boot_images.py)."""

    async def spawn_ready(self, template: Template) -> SandboxProcess:
        """A ready sandbox: restored from the template's image, or booted (making one)."""
        ...

    async def close(self) -> None: ...


class IsolationBackend(Protocol):
    """What the manager needs of a backend; every difference between backends is said here."""

    name: str
    # --allow-egress can reach its sandboxes (gVisor's have no network at all).
    egress: bool
    # Why a fork copies no memory here ("" where it does): every cold fork says so on the wire.
    no_memory_fork: str

    def memory_forker(self) -> MemoryForker | None:
        """Itself where fork() copies memory; None: the manager's cold fork (a disk copy), which
        answers ``memory_copied: false`` with ``no_memory_fork`` and refuses ``require_memory``."""
        ...

    def boot_image_store(self, sandboxes_dir: Path, ready: Ready, kill: Kill) -> BootImageStore | None:
        """Where cold creates restore a booted image instead of booting (None: they boot)."""
        ...

    def socket_path(self, sandboxes_dir: Path, name: str) -> Path: ...

    def start(self, guest_dir: Path, templates: list[Template]) -> None: ...

    def describe(self) -> str: ...

    def expose_built(self, path: Path) -> None: ...

    def spawn(self, name: str, template: Template, sandboxes_dir: Path) -> SandboxProcess: ...

    def kill(self, sp: SandboxProcess) -> None: ...

    def stop_job(self, sp: SandboxProcess) -> int | None:
        """The memory guard's stop: SIGKILL the sandbox's job (its exec answers 137, as after an
        OOM kill) and keep the sandbox; how many processes were killed. None where a job cannot be
        stopped alone and free its memory: the guard stops the sandbox instead."""
        ...

    def reap_leftovers(self, sandboxes_dir: Path) -> list[str]: ...

    def close(self) -> None: ...
