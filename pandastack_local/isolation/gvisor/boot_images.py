"""Boot images: gVisor's cold creates restore a booted sandbox instead of booting one.

Most of a gVisor cold start is the agent's interpreter starting inside the sentry
(every import is a trip through gVisor's file system). So the first sandbox of a
template boots, and one more is booted, quiesced and checkpointed, never used, as
the template's image; every later create and pool refill restores that image. A
restore that fails drops the image and boots, so an image can slow a create down
once but never fail it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import uuid
from pathlib import Path
from typing import Protocol

from pandastack_local import agent_client
from pandastack_local.isolation import process
from pandastack_local.isolation.backend import Kill, Ready
from pandastack_local.templates.registry import Template

log = logging.getLogger(__name__)


class ImageBackend(Protocol):
    """What boot images need of their backend (gvisor/backend.py's GvisorBackend, which builds on
    this module)."""

    def has_boot_image(self, template: Template) -> bool: ...
    def spawn(self, name: str, template: Template, sandboxes_dir: Path) -> process.SandboxProcess: ...
    def boot(self, name: str, template: Template, sandboxes_dir: Path) -> process.SandboxProcess: ...
    def drop_boot_image(self, template: Template) -> None: ...
    def prepare_quiesce(self, sp: process.SandboxProcess) -> None: ...
    def save_boot_image(self, sp: process.SandboxProcess, template: Template) -> None: ...


def boot_image_key(template: Template) -> str:
    """One boot image per template as it is now: a rebuilt template (new environment, new
    limits) gets a new image, since the agent's limits and environment are in the image."""
    ident = json.dumps(dataclasses.astuple(template), default=str)  # name, limits, env, built dir...
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


class BootImages:
    """Makes and uses one boot image per template (see the module docstring)."""

    def __init__(self, backend: ImageBackend, sandboxes_dir: Path, ready: Ready, kill: Kill) -> None:
        self.backend = backend
        self.sandboxes_dir = sandboxes_dir
        self.ready = ready
        self.kill = kill
        self.tried: set[str] = set()  # one attempt per template version and server
        self.tasks: list[asyncio.Task[None]] = []

    async def spawn_ready(self, template: Template) -> process.SandboxProcess:
        """A ready sandbox: restored from the template's image, or booted (and an image made)."""
        if self.backend.has_boot_image(template):
            process = self.backend.spawn(str(uuid.uuid4()), template, self.sandboxes_dir)
            try:
                return await self.ready(process)
            except Exception as exc:  # noqa: BLE001  a bad image must not fail the create
                log.warning("template %s's boot image did not restore (%s): booting", template.name, exc)
                self.backend.drop_boot_image(template)
        process = await self.ready(self.backend.boot(str(uuid.uuid4()), template, self.sandboxes_dir))
        key = boot_image_key(template)
        if key not in self.tried:
            self.tried.add(key)
            self.tasks.append(asyncio.create_task(self._make(template)))
        return process

    async def _make(self, template: Template) -> None:
        """Boot a sandbox nobody gets, quiesce its agent and checkpoint it as the image."""
        process = self.backend.boot(str(uuid.uuid4()), template, self.sandboxes_dir)
        try:
            await self.ready(process)
            self.backend.prepare_quiesce(process)
            await agent_client.quiesce(process.socket_path)
            await asyncio.to_thread(self.backend.save_boot_image, process, template)
            log.warning("boot image of template %s made: cold creates restore it", template.name)
        except Exception as exc:  # noqa: BLE001  no image: creates keep booting
            log.warning("no boot image for template %s (%s): cold creates boot", template.name, exc)
        finally:
            with contextlib.suppress(Exception):
                await self.kill(process)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
