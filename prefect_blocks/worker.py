"""The ``pandastack`` work pool type: each flow run of a deployment in its own fresh sandbox.

``prefect worker start --pool P --type pandastack`` polls the pool like any worker and
runs each flow run through the core lifecycle (``pandastack_jobs.run_job``): a fresh
sandbox tagged with the flow run and its attempt (so a rerun deletes what a dead
attempt left), Prefect's standard flow-run command inside it (``prefect flow-run
execute``: the deployment's pull steps, then the flow), output streamed, exit code
back to the worker, the sandbox deleted in ``finally``. ``infrastructure_pid`` is the
sandbox id; a flow run moving to Cancelling deletes its sandbox and ends Cancelled.

What enters the sandbox is only what the flow run needs: the Prefect API URL (and key
or auth string, if the worker has one), the flow run id, the worker's attribution
variables and the env configured on the pool/deployment, written to a file in the
guest (not on a command line) and sourced by the command. Never the PandaStack key and
never the rest of the worker's settings (its database URL, its profile).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shlex
import sys
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Optional
from uuid import UUID, uuid4

import anyio
import anyio.abc
import anyio.to_thread
import pandastack
from prefect.client.schemas.objects import StateType
from prefect.exceptions import InfrastructureNotFound, ObjectNotFound
from prefect.workers.base import BaseJobConfiguration, BaseVariables, BaseWorker, BaseWorkerResult
from pydantic import BaseModel, Field, PrivateAttr

from pandastack_jobs import (
    Engine,
    FailureKind,
    JobHandle,
    JobKey,
    JobOutcome,
    JobSpec,
    Redactor,
    run_job,
)
from pandastack_jobs.reaper import delete_sandbox
from pandastack_jobs.warm_start import STANDBY_LABEL, StandbyPool

from .credentials import DOCS_URL, LOGO_URL, PandaStackCredentials, resolve_credentials
from .sandbox import option_field
from .warm import META_INSTANCE, WarmPools, warm_command

if TYPE_CHECKING:
    from prefect.client.schemas.objects import Flow as APIFlow
    from prefect.client.schemas.objects import FlowRun, WorkPool
    from prefect.client.schemas.responses import DeploymentResponse

ENGINE = Engine.PREFECT_WORKER
DEFAULT_TEMPLATE = "prefect"
DEFAULT_TIMEOUT = 3600.0
ENV_FILE = "/work/.prefect/flow-run.env"
CANCEL_POLL_SECONDS = 2.0
SWEEP_EVERY_POLLS = 6
# The worker's own settings that a flow run inside needs; every other setting stays out.
FORWARDED_SETTINGS = ("PREFECT_API_URL", "PREFECT_API_KEY", "PREFECT_API_AUTH_STRING")
DEFAULT_HEARTBEAT_SECONDS = 30
MISSED_HEARTBEATS = 3
# A loaded worker's heartbeats can lag seconds: never call one dead sooner than this.
MIN_OFFLINE_SECONDS = 60.0
MAX_WARM_POOL_SIZE = 16
META_POOL = "prefect_work_pool"
META_WORKER = "prefect_worker"
META_FLOW_RUN = "prefect_flow_run_id"
FINAL = frozenset({StateType.COMPLETED, StateType.FAILED, StateType.CANCELLED, StateType.CRASHED})

logger = logging.getLogger(__name__)


class PandaStackWorkerFields(BaseModel):
    """The fields of a ``pandastack`` work pool, declared once: the base job template's variables
    (:class:`PandaStackWorkerVariables`) and the configuration a flow run gets
    (:class:`PandaStackJobConfiguration`) both inherit them. ``template``, ``timeout`` and ``ttl``
    are the core's job options (type and description from ``JobSpec``); a flow run's defaults are
    its own (the template must hold Prefect, a flow run may take an hour)."""

    credentials: Optional[PandaStackCredentials] = Field(
        default=None,
        title="PandaStack credentials",
        description=(
            "PandaStack Credentials block with the API URL and key the worker creates sandboxes with; "
            "empty means PANDASTACK_API / PANDASTACK_API_KEY in the worker's environment. "
            "The key never enters the sandbox."
        ),
    )
    template: str = option_field(
        "template",
        DEFAULT_TEMPLATE,
        "It must contain Prefect and the flow's dependencies (locally: a python_env template of "
        "pandastack-local) and be able to reach the Prefect API (locally: pandastack-local serve "
        "--allow-egress HOST:PORT).",
        title="Sandbox template",
    )
    timeout: float = option_field(
        "timeout", DEFAULT_TIMEOUT, "Here: of one flow run.", gt=0, title="Timeout (seconds)"
    )
    ttl: Optional[int] = option_field(
        "ttl",
        None,
        "The server deletes a sandbox nobody talks to (a SIGKILLed worker's) after it.",
        title="Sandbox TTL (seconds)",
    )
    max_concurrent_sandboxes: Optional[int] = Field(
        default=None,
        ge=1,
        title="Concurrent sandboxes per worker",
        description=(
            "At most this many flow runs hold a sandbox at once on one worker; further runs wait on "
            "the worker. Use the work pool's concurrency limit for a cap across workers."
        ),
    )
    stream_output: bool = Field(
        default=True,
        title="Stream output",
        description="Print the sandbox's stdout/stderr on the worker's console as it arrives.",
    )
    warm_pool_size: int = Field(
        default=0,
        ge=0,
        le=MAX_WARM_POOL_SIZE,
        title="Warm standbys",
        description=(
            "Keep this many standby sandboxes per warm key, each with the Prefect engine already "
            "imported, so a flow run skips Prefect's start-up; a standby serves exactly one flow run "
            "and is deleted with it. 0 (the default) runs every flow run cold. Only the default "
            "command runs warm; a flow run whose PREFECT_* settings differ from the standby's, or "
            "that finds none ready, runs cold. Each waiting standby holds its interpreter's memory."
        ),
    )


class PandaStackJobConfiguration(BaseJobConfiguration, PandaStackWorkerFields):
    """How one flow run becomes one sandbox (filled from the pool's base job template)."""

    _sandbox_env: dict[str, str] = PrivateAttr(default_factory=dict)

    def prepare_for_flow_run(
        self,
        flow_run: FlowRun,
        deployment: DeploymentResponse | None = None,
        flow: APIFlow | None = None,
        work_pool: WorkPool | None = None,
        worker_name: str | None = None,
        worker_id: UUID | None = None,
    ) -> None:
        configured = {k: v for k, v in (self.env or {}).items() if v is not None}
        reserved = sorted(k for k in configured if k.upper().startswith("PANDASTACK"))
        if reserved:
            raise ValueError(
                f"env {reserved} of the pandastack work pool is reserved: the PandaStack key and URL "
                "belong to the worker (set them in the credentials block), never to the flow run"
            )
        super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id)
        # The base merged the worker's whole settings into env; keep only what the run needs.
        self._sandbox_env = {
            k: v
            for k, v in self.env.items()
            if v is not None and (k in FORWARDED_SETTINGS or k.startswith("PREFECT__") or k in configured)
        }
        self.env = dict(self._sandbox_env)

    def sandbox_env(self) -> dict[str, str]:
        return dict(self._sandbox_env)

    def client(self) -> pandastack.Client:
        return resolve_credentials(self.credentials).get_client()

    def resolved_credentials(self) -> PandaStackCredentials:
        return resolve_credentials(self.credentials)

    def redactor(self) -> Redactor:
        redactor = resolve_credentials(self.credentials).redactor()
        for name in ("PREFECT_API_KEY", "PREFECT_API_AUTH_STRING"):
            redactor.add(self._sandbox_env.get(name))
        return redactor

    def job_spec(self, flow_run: FlowRun, pool: str, worker: str) -> JobSpec:
        """The core's description of this flow run: one sandbox, the flow-run command, no result file."""
        env_file = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(self._sandbox_env.items()))
        # A cold command in the flow run's own sandbox; a standby runs warm_command instead.
        return JobSpec(
            command=f". {ENV_FILE} && exec {self.command}",
            files={ENV_FILE: env_file},
            result_path=None,
            template=self.template,
            timeout=self.timeout,
            ttl=self.ttl,
            metadata={META_POOL: pool, META_WORKER: worker, META_FLOW_RUN: str(flow_run.id)},
            key=JobKey(
                engine=ENGINE,
                workflow=pool,
                task="flow-run",
                run=str(flow_run.id),
                try_number=(flow_run.run_count or 0) + 1,
            ),
        )


class PandaStackWorkerVariables(BaseVariables, PandaStackWorkerFields):
    """The fields of a ``pandastack`` work pool's base job template (overridable per deployment)."""


class PandaStackWorkerResult(BaseWorkerResult):
    """The flow-run command's exit code in its sandbox (the sandbox id is the identifier)."""


class PandaStackWorker(
    BaseWorker[PandaStackJobConfiguration, PandaStackWorkerVariables, PandaStackWorkerResult]
):
    """Runs each flow run of a ``pandastack`` work pool in its own PandaStack sandbox."""

    type = "pandastack"
    job_configuration = PandaStackJobConfiguration
    job_configuration_variables = PandaStackWorkerVariables
    _description = (
        "Run each flow run in its own throwaway PandaStack sandbox (microVM): isolated "
        "infrastructure per flow run, deleted when the run ends."
    )
    _display_name = "PandaStack"
    _documentation_url = DOCS_URL
    _logo_url = LOGO_URL

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_flight: set[str] = set()
        self._limiters: dict[int, anyio.CapacityLimiter] = {}
        self._polls = 0
        self._instance = str(uuid4())
        self._warm: WarmPools | None = None

    def warm_pools(self) -> WarmPools:
        """The standby pools of this worker (made on first use; closed in ``teardown``)."""
        if self._warm is None:
            self._warm = WarmPools(
                {META_POOL: self._work_pool_name, META_WORKER: self.name, META_INSTANCE: self._instance}
            )
        return self._warm

    async def prewarm(self) -> Optional[StandbyPool]:
        """Start the standby pool of the work pool's defaults now, so the first flow run that
        arrives already finds one ready (the CLI worker does this on its first poll)."""
        from prefect.client.schemas.objects import FlowRun as APIFlowRun

        defaults: PandaStackJobConfiguration = await self.job_configuration.from_template_and_values(
            self.work_pool.base_job_template, {}, client=self.client
        )
        if defaults.warm_pool_size <= 0:
            return None
        # The per-run variables are not part of the key: any flow run stands in for the real ones.
        defaults.prepare_for_flow_run(
            APIFlowRun(flow_id=uuid4(), name="prewarm"), work_pool=self.work_pool, worker_name=self.name
        )
        return await anyio.to_thread.run_sync(self.warm_pools().ensure, defaults)

    async def teardown(self, *exc_info: Any) -> None:
        """Stop as Prefect does, then close the standby pools: no standby outlives its worker."""
        try:
            await super().teardown(*exc_info)
        finally:
            warm, self._warm = self._warm, None
            if warm is not None:
                await anyio.to_thread.run_sync(warm.close)

    async def start(self, *args: Any, **kwargs: Any) -> Any:
        """Refuse to start without credentials: otherwise every flow run it claims crashes."""
        await self.check_credentials()
        return await super().start(*args, **kwargs)

    async def check_credentials(self) -> PandaStackCredentials:
        """The credentials the pool's defaults resolve to (its block, the environment, the saved
        default block); raises ``pandastack.AuthError`` naming the ways to give them."""
        from prefect.client.orchestration import get_client

        block: Optional[PandaStackCredentials] = None
        async with get_client() as client:
            try:
                pool = await client.read_work_pool(self._work_pool_name)
            except ObjectNotFound:  # the worker creates it with the default template: no block
                pool = None
            if pool is not None:
                defaults = await self.job_configuration.from_template_and_values(
                    pool.base_job_template, {}, client=client
                )
                block = defaults.credentials  # type: ignore[attr-defined]
        try:
            return await anyio.to_thread.run_sync(resolve_credentials, block)
        except pandastack.AuthError as exc:
            raise pandastack.AuthError(
                f"pandastack worker for pool {self._work_pool_name!r} has no PandaStack credentials, so "
                f"every flow run would crash: {exc}; or set the pool's credentials job variable"
            ) from None

    async def run(
        self,
        flow_run: FlowRun,
        configuration: PandaStackJobConfiguration,
        task_status: Optional[anyio.abc.TaskStatus[Any]] = None,
    ) -> PandaStackWorkerResult:
        """Run the flow run in a fresh sandbox; reports the sandbox id as its infrastructure pid."""
        cap = configuration.max_concurrent_sandboxes
        limiter = self._limiters.setdefault(cap, anyio.CapacityLimiter(cap)) if cap else None
        async with limiter if limiter is not None else contextlib.nullcontext():
            return await self._run_in_sandbox(flow_run, configuration, task_status)

    async def _run_in_sandbox(
        self,
        flow_run: FlowRun,
        configuration: PandaStackJobConfiguration,
        task_status: Optional[anyio.abc.TaskStatus[Any]],
    ) -> PandaStackWorkerResult:
        run_logger = self.get_flow_run_logger(flow_run)
        spec = configuration.job_spec(flow_run, self._work_pool_name, self.name)
        handle = JobHandle()
        redactor = configuration.redactor()
        created: list[str] = []
        created_event, done = anyio.Event(), anyio.Event()

        def on_created(sandbox_id: str) -> None:
            created.append(sandbox_id)
            anyio.from_thread.run_sync(created_event.set)

        def on_output(stream: str, chunk: str) -> None:
            if configuration.stream_output:
                (sys.stdout if stream == "stdout" else sys.stderr).write(chunk)

        client = configuration.client()
        standby = None
        if configuration.warm_pool_size > 0:
            standby = await anyio.to_thread.run_sync(self.warm_pools().take, configuration)
        job = functools.partial(
            run_job,
            client,
            spec,
            standby=standby,
            standby_command=warm_command(standby, ENV_FILE) if standby is not None else None,
            on_created=on_created,
            on_output=on_output,
            handle=handle,
            redactor=redactor,
        )
        outcomes: list[JobOutcome] = []

        async def run_in_thread() -> None:
            try:
                outcomes.append(await anyio.to_thread.run_sync(job))
            finally:
                done.set()

        self._in_flight.add(str(flow_run.id))
        cancelled = False
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(run_in_thread)
                # task_status.started must be called from this task (the one the worker started).
                while not (created_event.is_set() or done.is_set()):
                    with anyio.move_on_after(0.5):
                        await created_event.wait()
                if created and task_status is not None:
                    task_status.started(created[0])
                while not done.is_set():
                    with anyio.move_on_after(CANCEL_POLL_SECONDS):
                        await done.wait()
                    if not done.is_set() and not cancelled and await self._cancel_requested(flow_run.id):
                        cancelled = True
                        run_logger.info("Flow run is cancelling: deleting its sandbox")
                        await anyio.to_thread.run_sync(handle.cancel)
        finally:
            self._in_flight.discard(str(flow_run.id))
        outcome = outcomes[0]
        if standby is not None:
            run_logger.info(
                "Flow run took standby %s%s",
                standby.sandbox_id,
                "" if outcome.standby else ": it was gone, so it ran cold in a fresh sandbox",
            )
        if cancelled or handle.cancelled:
            await self._mark_cancelled(flow_run)
            return PandaStackWorkerResult(identifier=outcome.sandbox_id or "", status_code=0)
        if outcome.sandbox_id is None or not created:
            raise RuntimeError(f"could not start the flow run's sandbox: {outcome.reason}")
        if not outcome.ok:
            tail = (outcome.stderr_tail or outcome.stdout_tail).strip().splitlines()[-20:]
            run_logger.error(
                "Flow run sandbox %s ended: %s%s",
                outcome.sandbox_id,
                outcome.reason,
                ("\n" + "\n".join(tail)) if tail else "",
            )
        code = outcome.exit_code if outcome.exit_code is not None else (0 if outcome.ok else 1)
        if outcome.kind is FailureKind.TIMEOUT and code == 0:
            code = 124
        return PandaStackWorkerResult(identifier=outcome.sandbox_id, status_code=code)

    async def _cancel_requested(self, flow_run_id: UUID) -> bool:
        try:
            current = await self.client.read_flow_run(flow_run_id)
        except ObjectNotFound:
            return True
        except Exception:  # noqa: BLE001 - an unreachable API proves nothing; ask again later
            return False
        state = current.state
        return state is not None and state.type in (StateType.CANCELLING, StateType.CANCELLED)

    async def _mark_cancelled(self, flow_run: FlowRun) -> None:
        with contextlib.suppress(ObjectNotFound):
            current = await self.client.read_flow_run(flow_run.id)
            if current.state is None or current.state.type != StateType.CANCELLED:
                await self._mark_flow_run_as_cancelled(
                    current, state_updates={"message": "Flow run cancelled: its sandbox was deleted."}
                )

    async def kill_infrastructure(
        self,
        infrastructure_pid: str,
        configuration: PandaStackJobConfiguration,
        grace_seconds: int = 30,
    ) -> None:
        """Delete the flow run's sandbox (``infrastructure_pid`` is its id)."""
        client = configuration.client()
        deleted = await anyio.to_thread.run_sync(delete_sandbox, client, infrastructure_pid)
        if not deleted:
            raise InfrastructureNotFound(f"sandbox {infrastructure_pid} does not exist")

    # -- orphans of dead workers -------------------------------------------------------------

    async def get_and_submit_flow_runs(self) -> list[FlowRun]:
        if self._polls == 0:
            try:
                await self.prewarm()
            except Exception as exc:  # noqa: BLE001 - without standbys flow runs still run, cold
                self._logger.warning("could not start the standby pool: %s", exc)
        if self._polls % SWEEP_EVERY_POLLS == 0:
            try:
                defaults: PandaStackJobConfiguration = await self.job_configuration.from_template_and_values(
                    self.work_pool.base_job_template, {}, client=self.client
                )
                await self.sweep_orphans(defaults.credentials)
            except Exception as exc:  # noqa: BLE001 - a failed sweep must not stop polling
                self._logger.warning("orphan sweep failed: %s", exc)
        self._polls += 1
        return await super().get_and_submit_flow_runs()

    async def sweep_orphans(self, credentials: Optional[PandaStackCredentials] = None) -> list[str]:
        """Delete sandboxes of this pool that no live worker runs, and mark their runs Crashed.

        A sandbox is an orphan when its flow run is already final, when it was made by this
        worker's name but is not one of its runs (a previous life of a restarted worker), or
        when its worker is no longer online in the pool (missed heartbeats). A standby is an
        orphan only in the last two cases (it names no flow run: none is marked Crashed).
        """
        pool = self._work_pool_name
        online = {w.name for w in await self.client.read_workers_for_work_pool(pool) if _online(w)}
        client = resolve_credentials(credentials).get_client()
        listed = await anyio.to_thread.run_sync(client.sandboxes.list)
        candidates = [sb for sb in listed if (sb.metadata or {}).get(META_POOL) == pool]
        orphans: dict[str, str] = {}
        for sb in candidates:
            meta = sb.metadata or {}
            run_id, owner = meta.get(META_FLOW_RUN, ""), meta.get(META_WORKER, "")
            if STANDBY_LABEL in meta:
                # A standby (waiting, or taken by a run: it names no run) is its pool's to delete;
                # an orphan only once its worker is gone, or is this worker's previous life.
                mine = owner == self.name and meta.get(META_INSTANCE) == self._instance
                if not mine and (owner == self.name or owner not in online):
                    orphans[sb.id] = ""
                continue
            if owner == self.name:
                if run_id not in self._in_flight:
                    orphans[sb.id] = run_id
            elif owner not in online or await self._is_final(run_id):
                orphans[sb.id] = run_id
        if not orphans:
            return []
        deleted = [
            sandbox_id
            for sandbox_id in orphans
            if await anyio.to_thread.run_sync(delete_sandbox, client, sandbox_id)
        ]
        for sandbox_id in deleted:
            run_id = orphans.get(sandbox_id)
            if run_id and not await self._is_final(run_id):
                with contextlib.suppress(ObjectNotFound, ValueError):
                    flow_run = await self.client.read_flow_run(UUID(run_id))
                    await self._propose_crashed_state(
                        flow_run,
                        f"The worker running this flow run stopped; its sandbox {sandbox_id} was "
                        "deleted by another worker's sweep.",
                    )
        self._logger.info("swept %d orphaned sandbox(es): %s", len(deleted), deleted)
        return deleted

    async def _is_final(self, run_id: str) -> bool:
        try:
            flow_run = await self.client.read_flow_run(UUID(run_id))
        except (ObjectNotFound, ValueError):
            return True
        return flow_run.state is not None and flow_run.state.type in FINAL


def _online(worker: Any) -> bool:
    """Online and heartbeating: missed three heartbeats means gone (as Prefect's foreman decides,
    without waiting for its loop)."""
    status = getattr(worker, "status", None)
    if str(getattr(status, "value", status)).upper() != "ONLINE":
        return False
    last = getattr(worker, "last_heartbeat_time", None)
    if last is None:
        return False
    interval = getattr(worker, "heartbeat_interval_seconds", None) or DEFAULT_HEARTBEAT_SECONDS
    window = max(interval * MISSED_HEARTBEATS, MIN_OFFLINE_SECONDS)
    return (datetime.now(timezone.utc) - last).total_seconds() <= window
