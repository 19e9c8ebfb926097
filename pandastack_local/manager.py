"""The sandbox registry: create, delete, capacity, TTL, fork, pause, and the warm pool.

All spawning happens on the event-loop thread on purpose: bwrap's
``--die-with-parent`` is tied to the thread that started it, and the loop thread
lives as long as the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pandastack_local import agent_client
from pandastack_local.admission import Admission, Occupant, Stop
from pandastack_local.config import ServerConfig
from pandastack_local.exceptions import ApiError
from pandastack_local.guest.agent import HEARTBEAT_SECONDS
from pandastack_local.isolation import guest_dir
from pandastack_local.isolation.backend import MEMORY_FORK_FIX, MemoryForker
from pandastack_local.isolation.cgroups import Cgroups
from pandastack_local.isolation.egress import EgressError, EgressRelay, parse_rules
from pandastack_local.isolation.factory import make_backend
from pandastack_local.isolation.process import (
    MAX_SOCKET_PATH,
    ProcessTable,
    SandboxProcess,
    host_descendants,
    host_processes,
    keep_ahead,
    stop,
)
from pandastack_local.limits import fork_copy_cap
from pandastack_local.metrics import ServerMetrics
from pandastack_local.templates import pythonenv
from pandastack_local.templates.build import Builds, TemplateBuildError, TemplateNotReady, default_cache_dir
from pandastack_local.templates.registry import Template, template_registry

log = logging.getLogger(__name__)

DEFAULT_TTL_SECONDS = 300
MAX_FORK_COUNT = 16
# A memory fork of a sandbox already being forked (its agent quiesced for the checkpoint).
MEMORY_FORK_BUSY = "sandbox busy: another fork of it is under way; retry when it ends"
CAPACITY_RETRY_AFTER = "1"
LOG_LINES = 2000
TEMPLATE_BUILD_WAIT_SECONDS = 20.0  # a create waits this long for a template still being built
READY_TIMEOUT_SECONDS = 30.0  # generous: a loaded 2-core CI box can take seconds to start python
AGENT_LOSS_SETTLE_SECONDS = 3.0
PRESSURE_SCAN_SECONDS = 0.5  # how often the memory guard reads the sandboxes' memory use
# A request in flight keeps its sandbox busy (idle 0) while its agent showed life (a frame, the
# heartbeat included) this recently; past it, the sandbox counts as idle from that last sign.
BUSY_GRACE_SECONDS = 5 * HEARTBEAT_SECONDS  # room for a loaded host


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class Sandbox:
    id: str
    template: Template
    process: SandboxProcess
    created: float
    metadata: dict[str, str]
    ttl_seconds: int | None
    persistent: bool = False
    boot_ms: int = 0
    boot_mode: str = "cold"
    status: str = "running"
    # The last sign of use: a request's start and end, and each frame its agent sent during one.
    last_active: float = field(default_factory=time.monotonic)
    active_ops: int = 0
    # Requests in flight that wait on the server, not on the agent (a fork's checkpoint): busy.
    held_ops: int = 0
    active_execs: int = 0
    # Why the sandbox was lost (its agent stopped answering) or deleted; "" while it is not.
    ended: str = ""
    resumed_at: float = float("-inf")
    logs: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_LINES))
    # The boundary around it: "bwrap" or "gvisor" (isolation/backend.py).
    isolation: str = "bwrap"
    # A fork child: whether the parent's memory and processes came with its disk (None: no fork).
    memory_copied: bool | None = None

    def to_json(self) -> dict[str, Any]:
        if self.status in ("running", "paused") and not self.process.alive():
            self.status = "failed"
        return {
            "id": self.id,
            "template": self.template.name,
            "cpu": self.template.cpu,
            "memory_mb": self.template.memory_mb,
            "status": self.status,
            "guest_ip": None,
            "boot_ms": self.boot_ms,
            "boot_mode": self.boot_mode,
            "created_at": rfc3339(self.created),
            "metadata": {k: v for k, v in self.metadata.items() if not k.startswith("secret.")},
            "from_snapshot": None,
            "persistent": self.persistent,
            "isolation": self.isolation,
            "memory_copied": self.memory_copied,
        }

    def log(self, line: str) -> None:
        stamp = datetime.now(timezone.utc).strftime("%H:%M:%S.%f")[:-3]
        for part in line.splitlines() or [""]:
            self.logs.append(f"{stamp} {part}")


class SandboxManager:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.templates = template_registry(config.template_dirs)
        self.builds = Builds(self.templates, Path(config.cache_dir or default_cache_dir()), log.warning)
        self.state_dir = Path(config.state_dir).resolve()
        pythonenv.check_outside(self.templates.values(), self.state_dir)
        self.sandboxes_dir = self.state_dir / "sandboxes"
        instance = hashlib.sha256(str(self.state_dir).encode()).hexdigest()[:12]
        self.cgroups = Cgroups.detect(instance)
        self.admission = Admission(config.admission, config.memory_budget_mb, self.cgroups)
        # False once start() finds the server could not lower its own OOM score (no floor then)
        self.server_protected = True
        self.backend = make_backend(config.isolation, self.cgroups, instance, config.runsc)
        self.egress = EgressRelay(parse_rules(config.allow_egress))
        if self.egress and not self.backend.egress:
            raise ValueError(
                "--allow-egress is not supported with --isolation gvisor (its sandboxes have no "
                "network at all): use --isolation bwrap for jobs that need a host endpoint"
            )
        self.boot_images = self.backend.boot_image_store(self.sandboxes_dir, self._ready, self._kill)
        self.sandboxes: dict[str, Sandbox] = {}
        self.pending = 0
        self.pending_memory_mb = 0
        self.pool: dict[str, deque[SandboxProcess]] = {}
        self._refilling: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self.teardowns: set[asyncio.Task[None]] = set()
        self.forking: set[str] = set()  # sandboxes with a memory fork (checkpoint) under way
        # What admitted memory forks' children not registered yet will use: admission counts it,
        # so two forks at once cannot each be admitted against the same free memory.
        self.fork_reserved_mb = 0
        self.started = time.time()
        self.metrics = ServerMetrics(self)

    # ---- start-up and shutdown -------------------------------------------------
    async def start(self) -> None:
        longest = self.backend.socket_path(self.sandboxes_dir, str(uuid.UUID(int=0)))
        if len(os.fsencode(longest)) > MAX_SOCKET_PATH:
            raise RuntimeError(
                f"the state dir {self.state_dir} is too deep for the sandboxes' agent sockets "
                f"({len(os.fsencode(longest))} bytes > {MAX_SOCKET_PATH}, the AF_UNIX limit): "
                "pass a shorter --state-dir"
            )
        self.state_dir.mkdir(parents=True, exist_ok=True)
        reaped = self.backend.reap_leftovers(self.sandboxes_dir)
        if reaped:
            log.warning("reaped %d sandbox(es) left by a previous run: %s", len(reaped), ", ".join(reaped))
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        self.guest_dir = guest_dir.prepare_guest_dir(self.state_dir / "guest")
        self.backend.start(self.guest_dir, list(self.templates.values()))
        log.warning("isolation: %s; %s", self.backend.describe(), self.cgroups.summary())
        log.warning("%s", self.admission.describe())
        self.server_protected = self.admission.protect_server()
        if not self.server_protected:
            log.warning(
                "admission: the server's oom_score_adj stays %s (lowering it needs CAP_SYS_RESOURCE): "
                "under host memory pressure the kernel's OOM killer may pick the server",
                Path("/proc/self/oom_score_adj").read_text().strip(),
            )
        for note in self.cgroups.notes:
            log.warning("isolation: %s", note)
        if "memory" in self.cgroups.missing:
            log.warning(
                "isolation: memory limit falls back to RLIMIT_AS per process (no OOM wall per sandbox)"
            )
        if "pids" in self.cgroups.missing:
            log.warning("isolation: NO process-count limit: a fork bomb is not contained")
        self._tasks.append(asyncio.create_task(self._ttl_loop()))
        if self.admission.guarded or not self.server_protected:  # a guard, or scores to keep ahead
            self._tasks.append(asyncio.create_task(self._pressure_loop()))
        if self.config.pool_size > 0:
            for name in ("code-interpreter", "base"):
                self._schedule_refill(name)

    async def close(self) -> None:
        await self.builds.close()
        if self.boot_images is not None:
            await self.boot_images.close()
        for task in self._tasks:
            task.cancel()
        if self.teardowns:  # deleted sandboxes still being removed: finish them first
            await asyncio.gather(*self.teardowns, return_exceptions=True)
        victims = [sb.process for sb in self.sandboxes.values()]
        for pool in self.pool.values():
            victims.extend(pool)
        self.sandboxes.clear()
        self.pool.clear()
        for sp in victims:
            await self._kill(sp)
        self.cgroups.reap_all()
        self.cgroups.remove_bases()
        self.backend.close()

    # ---- lookup ---------------------------------------------------------------
    def get(self, sandbox_id: str) -> Sandbox:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            raise ApiError(404, "not found")
        return sb

    def running(self, sandbox_id: str) -> Sandbox:
        sb = self.get(sandbox_id)
        if sb.ended:
            raise ApiError(500, f"sandbox {sb.id} is not running: {sb.ended}")
        if sb.status == "paused":
            raise ApiError(409, "sandbox is paused")
        if not sb.process.alive():
            sb.status = "failed"
            raise ApiError(500, "sandbox is not running (its processes have exited)")
        return sb

    def watch(self, sb: Sandbox, silence: float = agent_client.AGENT_SILENCE_SECONDS) -> agent_client.Watch:
        """How a request to ``sb``'s agent reports signs of life and waits out a pause."""

        def alive() -> None:
            sb.last_active = time.monotonic()

        def hold() -> bool:  # frozen on purpose, or just thawed (its heartbeat not back yet)
            return sb.status == "paused" or time.monotonic() - sb.resumed_at < silence

        return agent_client.Watch(alive=alive, hold=hold, silence=silence)

    async def agent_lost(self, sb: Sandbox, exc: agent_client.AgentUnavailable) -> ApiError:
        """What a request that lost its agent answers. An agent that stopped answering
        (``AgentLost``) marks its sandbox lost: it is killed at once, every later request fails at
        once, and the record goes with its TTL. An agent that went away (its sandbox dying: the
        agent is its init's only child) is waited for briefly, so a client asking right after
        sees ``failed``."""
        if isinstance(exc, agent_client.AgentDeadline):
            return ApiError(500, str(exc))
        if sb.ended:
            return ApiError(500, f"sandbox {sb.id} is not running: {sb.ended}")
        if isinstance(exc, agent_client.AgentLost):
            await self.mark_lost(sb, str(exc))
            return ApiError(500, f"sandbox {sb.id}: {exc}; it was killed")
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(sb.process.proc.wait, AGENT_LOSS_SETTLE_SECONDS)
        if sb.status in ("running", "paused") and not sb.process.alive():
            sb.status = "failed"
        return ApiError(500, str(exc))

    async def mark_lost(self, sb: Sandbox, why: str) -> None:
        """The sandbox's agent does not answer: kill its processes now (the record stays, failed,
        until it is deleted or its TTL passes)."""
        if sb.ended:
            return
        sb.ended = f"its agent stopped answering and it was killed ({why})"
        sb.status = "failed"
        sb.last_active = time.monotonic()
        sb.log(f"lost: {sb.ended}")
        log.warning("sandbox %s lost: %s", sb.id, why)
        await self._kill(sb.process)

    @contextlib.contextmanager
    def activity(self, sb: Sandbox, hold: bool = False) -> Any:
        """Mark the sandbox busy: the idle TTL counts from the end of its last request, or from
        its agent's last sign of life during one (``watch``). ``hold``: the request waits on the
        server itself (a fork's checkpoint), busy however long that takes (it has deadlines)."""
        sb.active_ops += 1
        sb.held_ops += hold
        sb.last_active = time.monotonic()
        try:
            yield sb
        finally:
            sb.active_ops -= 1
            sb.held_ops -= hold
            sb.last_active = time.monotonic()

    def idle_seconds(self, sb: Sandbox, now: float | None = None) -> float:
        """Seconds since the sandbox was last used: 0 while a request is in flight and its agent
        answers (or the server holds it); a request waiting on a silent agent does not count."""
        quiet = (time.monotonic() if now is None else now) - sb.last_active
        if sb.held_ops or (sb.active_ops and quiet <= BUSY_GRACE_SECONDS):
            return 0.0
        return quiet

    # ---- create / delete ------------------------------------------------------
    def template(self, name: str) -> Template:
        template = self.templates.get(name)
        if template is None:
            available = ", ".join(sorted(self.templates))
            # The real server's words (it tries to pull a template it does not have), plus the list.
            raise ApiError(
                500,
                f'template "{name}" is not on this host and could not be pulled: '
                f"available templates: {available}",
            )
        return template

    async def built(self, name: str, wait: float | None) -> Template:
        """The template with its software environment built (see templates.build)."""
        try:
            template: Template = await self.builds.ready(name, wait)
        except TemplateNotReady as exc:
            self.metrics.refused("template_not_ready")
            raise ApiError(503, str(exc), {"Retry-After": "5"}) from None
        except TemplateBuildError as exc:
            raise ApiError(500, f"template {name!r} is not available: {exc}") from None
        if template.built is not None:
            self.backend.expose_built(template.built)
        return template

    def _admit(self, template: Template, count: int = 1, copy_of: str | None = None) -> None:
        limit = self.config.max_sandboxes
        # What could not be admitted by an empty server is the client's mistake: a 400 naming the
        # field, never a capacity refusal its SDK and a queue consumer would wait out for ever.
        if limit is not None and count > limit:
            self.metrics.refused("never_fits")
            raise ApiError(
                400,
                f"count {count} is over this server's --max-sandboxes {limit}: it can never be "
                "admitted; ask for fewer, or start the server with a larger --max-sandboxes",
            )
        never = self.admission.never_fits(template.name, template.memory_mb, count)
        if never is not None:
            self.metrics.refused("never_fits")
            raise ApiError(400, never)
        if limit is not None and len(self.sandboxes) + self.pending + count > limit:
            self.metrics.refused("count_cap")
            raise ApiError(503, "no compute capacity available", {"Retry-After": CAPACITY_RETRY_AFTER})
        refusal = self.admission.refusal(
            self._occupants(),
            self.pending_memory_mb,
            self.pending,
            template.memory_mb,
            count,
            copy_of,
            self.fork_reserved_mb,
        )
        if refusal is not None:
            self.metrics.refused("memory")
            raise ApiError(507, refusal, {"Retry-After": CAPACITY_RETRY_AFTER})

    def _occupants(self) -> list[Occupant]:
        """Who holds memory: the live sandboxes, and under the usage policy the pool too (its
        sandboxes use memory; their limits are no claim until one is taken)."""
        # A lost sandbox's processes are gone: its record holds no memory.
        out = [
            Occupant(sb.id, sb.template, running_job=self._runs_job(sb))
            for sb in self.sandboxes.values()
            if not sb.ended
        ]
        if self.admission.policy == "usage":
            for name, pool in self.pool.items():
                if name in self.templates:
                    # The server's own spares (never above their share, skipped by _carry_out):
                    # not idle holders, so never reclaimed ahead of a tenant's sandbox.
                    out += [Occupant(sp.name, self.templates[name]) for sp in pool]
        return out

    @staticmethod
    def _runs_job(sb: Sandbox) -> bool:
        """A job runs in it: an exec in flight in a running (not paused) sandbox. Without one,
        what it holds is files or a frozen job's memory, which only stopping it frees."""
        return sb.status == "running" and sb.active_execs > 0

    def memory_health(self) -> dict[str, Any]:
        """/healthz's memory section: the budget, the total the guard measured on its last pass
        (at most ``PRESSURE_SCAN_SECONDS`` old; None without a guard) and what it did."""
        return {
            "admission": self.admission.policy,
            "budget_mb": self.admission.budget_mb,
            "used_mb": self.admission.last_total_mb,
            "guard": self.admission.counts.to_json(),
        }

    async def _pressure_loop(self) -> None:
        """The memory guard (admission.py): past the budget, the sandboxes furthest above their
        share lose their job (or, when their memory outlives it, the sandbox), never a neighbour
        below them, and the total is back under the budget within a pass or two."""
        while True:
            await asyncio.sleep(PRESSURE_SCAN_SECONDS)
            try:
                occupants = self._occupants()
                plan = (
                    await asyncio.to_thread(self.admission.relieve, occupants)
                    if self.admission.guarded
                    else []
                )
                if plan:
                    await self._carry_out(plan, self.admission.last_total_mb or 0)
                if not self.server_protected:  # no floor: put lowered scores back ahead
                    await asyncio.to_thread(self._keep_ahead, occupants)
            except Exception:  # the guard must outlive any one sandbox's state
                log.exception("memory guard: a pass failed")

    def _keep_ahead(self, occupants: list[Occupant]) -> None:
        """A server that could not lower its own OOM score set no floor for its sandboxes
        (``process.keep_ahead``): raise what a job lowered, each pass, and say so once a pass.
        Without cgroups, one /proc walk a pass serves every sandbox (not one walk each)."""
        raised = 0
        table: ProcessTable | None = None
        for o in occupants:
            sb = self.sandboxes.get(o.name)
            if self.cgroups.bases or sb is None:
                raised += keep_ahead(o.name, self.cgroups.pids(o.name))
            else:  # no cgroups (a non-root server on cgroup v1): the launcher's process tree
                pid = sb.process.pid
                table = host_processes() if table is None else table
                raised += keep_ahead(o.name, host_descendants(pid, table), launcher=pid)
        if raised:
            log.warning("memory guard: raised %d sandbox process(es) back to oom_score_adj 800", raised)

    async def _carry_out(self, plan: list[Stop], total_mb: int) -> None:
        """Stop what the guard picked, and say so: one line per pass, each sandbox in its own log."""
        done = []
        for pick in plan:
            sb = self.sandboxes.get(pick.name)
            if sb is None or sb.ended:
                continue  # a pool sandbox (never above its share) or one already gone
            over = (
                f"memory pressure on the host: the sandboxes used more than the "
                f"{self.admission.budget_mb} MB budget and this one held {pick.held_mb} MB"
            )
            if pick.idle:
                why = (
                    f"{over} with no job running (files or a paused sandbox's memory, which only "
                    "stopping it frees): reclaimed before any running job"
                )
            else:
                why = f"{over}, the most above its {pick.share_mb} MB share"
            # A job that ended since the pass measured: stopping it would free nothing.
            whole = (
                pick.whole
                or not self._runs_job(sb)
                or await asyncio.to_thread(self.backend.stop_job, sb.process) is None
            )
            if whole:
                pick = Stop(pick.name, True, pick.held_mb, pick.share_mb, pick.idle)
                sb.ended = f"stopped by the memory guard ({why})"
                sb.status = "failed"
                sb.last_active = time.monotonic()
                sb.log(f"lost: {sb.ended}")
                self.admission.forget(sb.id)
                # SIGKILL everything now (its memory comes back as the processes die); the removal
                # (cgroups, host dir) runs in the background, as a delete's does.
                if stop(sb.process, self.cgroups):
                    task = asyncio.create_task(self._kill(sb.process))
                    self.teardowns.add(task)
                    task.add_done_callback(self._torn_down)
                else:
                    await self._kill(sb.process)
            else:
                sb.log(f"{why}: its job was stopped (SIGKILL, exit 137)")
            self.admission.stopped(pick)
            what = "sandbox, no job running" if pick.idle else "sandbox" if whole else "job"
            done.append(f"{sb.id} ({pick.held_mb} MB: {what})")
        if done:
            counts = self.admission.counts
            text = (
                f"memory guard: {total_mb} MB in use past the {self.admission.budget_mb} MB budget "
                f"(share {plan[0].share_mb} MB): stopped {', '.join(done)}; since start "
                f"{counts.jobs_stopped} jobs and {counts.sandboxes_stopped} sandboxes stopped"
            )
            log.warning(text.replace("%", "%%"))

    async def create(
        self,
        template: Template,
        metadata: dict[str, str],
        ttl_seconds: int | None,
        persistent: bool = False,
    ) -> Sandbox:
        template = await self.built(template.name, TEMPLATE_BUILD_WAIT_SECONDS)
        self._admit(template)
        self.pending += 1
        self.pending_memory_mb += template.memory_mb
        started = time.monotonic()
        try:
            process, mode = await self._take_process(template)
            if mode == "cold" and process.restored:
                mode = "snapshot"  # the real server's word for a create restored from a snapshot
        finally:
            self.pending -= 1
            self.pending_memory_mb -= template.memory_mb
        sb = Sandbox(
            id=process.name,
            template=template,
            process=process,
            created=time.time(),
            metadata=dict(metadata),
            ttl_seconds=ttl_seconds,
            persistent=persistent,
            boot_ms=int((time.monotonic() - started) * 1000),
            boot_mode=mode,
            isolation=self.backend.name,
        )
        how = f"{mode}, restored from the template's boot image" if process.restored else mode
        sb.log(f"sandbox {sb.id} created from template {template.name} ({how})")
        self.sandboxes[sb.id] = sb
        self.metrics.created(template.name, mode, time.monotonic() - started)
        return sb

    async def _take_process(self, template: Template) -> tuple[SandboxProcess, str]:
        pool = self.pool.get(template.name)
        while pool:
            process = pool.popleft()
            self._schedule_refill(template.name)
            if process.alive():
                return process, "pool"
            await self._kill(process)
        if self.config.pool_size > 0:
            self._schedule_refill(template.name)
        return await self._spawn_ready(template), "cold"

    async def _spawn_ready(self, template: Template) -> SandboxProcess:
        if self.boot_images is not None:
            return await self.boot_images.spawn_ready(template)
        process = self.backend.spawn(str(uuid.uuid4()), template, self.sandboxes_dir)
        return await self._ready(process)

    async def _ready(self, process: SandboxProcess) -> SandboxProcess:
        """Wait for the new sandbox's agent to answer; attach its egress relay."""
        name = process.name
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while True:
            left = max(deadline - time.monotonic(), 0.1)
            try:
                await agent_client.call(
                    process.socket_path, {"op": "ping"}, agent_client.Watch(silence=left), left
                )
                break
            except agent_client.AgentUnavailable:
                if not process.alive() or time.monotonic() > deadline:
                    await self._kill(process)
                    raise ApiError(500, "sandbox failed to start (agent did not come up)") from None
                await asyncio.sleep(0.005)
        if self.egress:
            process.on_kill.append(lambda: self.egress.detach(name))
            try:
                await self.egress.attach(name, process.pid, host_descendants(process.pid))
            except EgressError as exc:
                await self._kill(process)
                raise ApiError(500, f"sandbox failed to start: {exc}") from None
        return process

    async def _kill(self, process: SandboxProcess) -> None:
        await asyncio.to_thread(self.backend.kill, process)

    def _schedule_refill(self, name: str) -> None:
        if self.config.pool_size <= 0 or name in self._refilling or name not in self.templates:
            return
        self._refilling.add(name)
        self._tasks.append(asyncio.create_task(self._refill(name)))

    async def _refill(self, name: str) -> None:
        """Keep a few pre-started, fully limited, never-used sandboxes per template.

        Missing ones start together: most of a start is waiting for bwrap and
        the agent's interpreter, which overlaps well even on two cores.
        """
        try:
            with contextlib.suppress(ApiError):  # a failed build is reported by create
                await self.built(name, None)
            pool = self.pool.setdefault(name, deque())
            while len(pool) < self.config.pool_size and name not in self.builds.errors:
                want = self.config.pool_size - len(pool)
                results = await asyncio.gather(
                    *(self._spawn_ready(self.templates[name]) for _ in range(want)), return_exceptions=True
                )
                for result in results:
                    if isinstance(result, SandboxProcess):
                        pool.append(result)
                if any(isinstance(r, BaseException) for r in results):
                    await asyncio.sleep(1)
                    return
        finally:
            self._refilling.discard(name)

    async def delete(self, sandbox_id: str, why: str = "it was deleted", cause: str = "api") -> None:
        """Answer once the sandbox is gone for its clients: out of the registry (404 by id, not
        counted by admission) and stopped (every process SIGKILLed: nothing runs or answers).
        Removing it (cgroups, host dir, uids: 10-40 ms under gVisor) finishes in the background;
        ``tearing_down`` counts those, shutdown waits for them and a restart reaps what a crash
        left of them. ``cause``: ``api``, ``ttl`` or ``cleanup`` (a failed fork's children), for /metrics."""
        started = time.monotonic()
        try:
            await self._delete(sandbox_id, why)
        finally:
            self.metrics.deleted(cause, time.monotonic() - started)

    async def _delete(self, sandbox_id: str, why: str) -> None:
        sb = self.sandboxes.pop(sandbox_id, None)
        if sb is None:
            raise ApiError(404, "not found")
        sb.status = "deleted"
        sb.ended = sb.ended or why
        self.admission.forget(sb.id)
        if not stop(sb.process, self.cgroups):
            await self._kill(sb.process)
            return
        task = asyncio.create_task(self._kill(sb.process))
        self.teardowns.add(task)
        task.add_done_callback(self._torn_down)

    def _torn_down(self, task: asyncio.Task[None]) -> None:
        self.teardowns.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("removing a deleted sandbox failed: %s", task.exception())

    @property
    def tearing_down(self) -> int:
        """Deleted sandboxes whose removal has not finished yet."""
        return len(self.teardowns)

    # ---- lifecycle ------------------------------------------------------------
    def lifecycle(self, sb: Sandbox) -> dict[str, Any]:
        idle = int(self.idle_seconds(sb))
        return {"ttl_seconds": sb.ttl_seconds or 0, "persistent": sb.persistent, "idle_seconds": idle}

    async def _ttl_loop(self) -> None:
        """Delete each sandbox idle past its TTL. A request in flight does not hold it forever:
        it counts as use only while its agent shows life (``idle_seconds``), and every request to
        an agent has deadlines (``agent_client``)."""
        while True:
            await asyncio.sleep(self.config.ttl_scan_interval)
            now = time.monotonic()
            for sb in list(self.sandboxes.values()):
                if sb.persistent or not sb.ttl_seconds:
                    continue
                idle = self.idle_seconds(sb, now)
                if idle >= sb.ttl_seconds:
                    log.warning("sandbox %s idle for %ds > ttl %ds: deleting", sb.id, idle, sb.ttl_seconds)
                    with contextlib.suppress(ApiError):
                        await self.delete(
                            sb.id, f"it was idle for {idle:.0f}s, past its TTL of {sb.ttl_seconds}s", "ttl"
                        )

    # ---- pause / resume -------------------------------------------------------
    async def pause(self, sb: Sandbox, paused: bool) -> None:
        if not sb.process.alive():
            raise ApiError(500, "sandbox is not running (its processes have exited)")
        if not self.cgroups.freeze(sb.id, paused):
            sig = signal.SIGSTOP if paused else signal.SIGCONT
            for pid in host_descendants(sb.process.pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
        sb.status = "paused" if paused else "running"
        if not paused:
            sb.resumed_at = time.monotonic()
        sb.log("paused" if paused else "resumed")

    # ---- fork -----------------------------------------------------------------
    async def fork(self, parent: Sandbox, count: int, require_memory: bool = False) -> list[Sandbox]:
        """Cold fork (bwrap): new sandboxes from the same template with a copy of the parent's
        disk, each marked ``memory_copied: False`` (the backend's ``no_memory_fork`` in its log);
        ``require_memory`` refuses it (409) before any child is made. Under gVisor a memory fork:
        see ``_memory_fork``."""
        if count < 1 or count > MAX_FORK_COUNT:
            raise ApiError(400, f"count must be between 1 and {MAX_FORK_COUNT}: got {count}")
        forker = self.backend.memory_forker()
        if forker is None and require_memory:
            raise ApiError(
                409, f"fork refused: require_memory: {self.backend.no_memory_fork}; {MEMORY_FORK_FIX}"
            )
        if forker is not None and parent.id in self.forking:
            # A second quiesce of the same agent would resume it under the first one's checkpoint.
            raise ApiError(409, f"fork failed: {MEMORY_FORK_BUSY}")
        self._admit(parent.template, count, copy_of=parent.id)
        if forker is not None:
            each = self.admission.need_mb(parent.template.memory_mb, 1, copy_of=parent.id)
            self.forking.add(parent.id)
            reserve = [each] * count  # one share per child, given back once it is registered
            self.fork_reserved_mb += sum(reserve)
            try:
                return await self._memory_fork(forker, parent, count, reserve)
            finally:
                self.forking.discard(parent.id)
                self.fork_reserved_mb -= sum(reserve)
        parent_watch = self.watch(parent)
        children: list[Sandbox] = []
        try:
            for _ in range(count):
                # A child lives as long as its parent would (the wire API has no TTL on fork).
                child = await self.create(
                    parent.template, {"forked_from": parent.id}, ttl_seconds=parent.ttl_seconds
                )
                child.boot_mode = "fork"
                child.memory_copied = False
                children.append(child)
                await agent_client.copy_disk(
                    parent.process.socket_path,
                    child.process.socket_path,
                    fork_copy_cap(parent.template),
                    parent_watch,
                    self.watch(child),
                )
                why = self.backend.no_memory_fork
                child.log(f"forked from {parent.id} (disk copied; memory NOT copied: {why})")
        except (agent_client.AgentUnavailable, agent_client.AgentError) as exc:
            for child in children:
                with contextlib.suppress(ApiError):
                    await self.delete(child.id, cause="cleanup")
            if isinstance(exc, agent_client.AgentLost) and exc.watch is parent_watch:
                raise await self.agent_lost(parent, exc) from exc
            too_big = isinstance(exc, agent_client.AgentError) and exc.errno == agent_client.TOO_BIG
            raise ApiError(409 if too_big else 500, f"fork failed: {exc}") from exc
        except BaseException:
            for child in children:
                with contextlib.suppress(ApiError):
                    await self.delete(child.id, cause="cleanup")
            raise
        parent.log(f"forked into {', '.join(c.id for c in children)}")
        self.metrics.forked("disk", len(children))
        return children

    async def _memory_fork(
        self, backend: MemoryForker, parent: Sandbox, count: int, reserve: list[int]
    ) -> list[Sandbox]:
        """Checkpoint the parent (it keeps running) and restore each child from the image: the
        children start with a copy of the parent's memory, processes and files. ``reserve``: the
        admission shares of the children still to come (one is given back per child registered,
        which then counts for what it uses)."""
        image = parent.process.directory / f"fork-{uuid.uuid4().hex[:8]}"
        backend.prepare_quiesce(parent.process)
        try:
            try:
                await agent_client.quiesce(parent.process.socket_path, self.watch(parent))
                await asyncio.to_thread(backend.checkpoint, parent.process, image)
            except agent_client.AgentError as exc:
                raise ApiError(409, f"fork failed: {exc}") from exc
            except agent_client.AgentLost as exc:
                raise await self.agent_lost(parent, exc) from exc
            except (agent_client.AgentUnavailable, RuntimeError) as exc:
                raise ApiError(500, f"fork failed: {exc}") from exc
            finally:
                backend.resume(parent.process)
            children: list[Sandbox] = []
            try:
                for _ in range(count):
                    started = time.monotonic()
                    self.pending += 1
                    self.pending_memory_mb += parent.template.memory_mb
                    try:
                        name = str(uuid.uuid4())
                        process = await self._ready(
                            backend.restore(name, parent.template, self.sandboxes_dir, image)
                        )
                    finally:
                        self.pending -= 1
                        self.pending_memory_mb -= parent.template.memory_mb
                    child = Sandbox(
                        id=name,
                        template=parent.template,
                        process=process,
                        created=time.time(),
                        metadata={"forked_from": parent.id},
                        ttl_seconds=parent.ttl_seconds,
                        boot_ms=int((time.monotonic() - started) * 1000),
                        boot_mode="fork",
                        isolation=backend.name,
                        memory_copied=True,
                    )
                    child.log(f"forked from {parent.id} (memory copied: checkpoint + restore)")
                    self.sandboxes[name] = child
                    self.fork_reserved_mb -= reserve.pop()
                    children.append(child)
            except BaseException:
                for child in children:
                    with contextlib.suppress(ApiError):
                        await self.delete(child.id, cause="cleanup")
                raise
        finally:
            await asyncio.to_thread(shutil.rmtree, image, True)
        parent.log(f"forked into {', '.join(c.id for c in children)} (memory copied)")
        self.metrics.forked("memory", len(children))
        return children
