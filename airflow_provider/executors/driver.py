"""The driver contract, and the PandaStack driver that fulfils it with the core.

The contract is Airflow ``common.sandbox``'s ``SandboxDriver`` (imported from that provider
when it is installed, see :mod:`.contract`): ``health_check``, ``launch``, ``validate_handle``,
``get_status``, ``terminate``, ``fence(request_id)``, ``recover(request_id)``, ``get_output``,
``close``; PandaStack adds ``read_file`` (the task log) and ``list_requests`` (the orphan
sweep). Every sandbox carries the task try's pre-assigned UUID in its metadata, so ``fence``
can find and delete every sandbox of a try even when its handle was never persisted.

Warm starts (:mod:`.warm`): with standby pools opened (``open_standbys``) a launch takes a
ready standby when the try fits one, and otherwise goes cold exactly as without pools. A
standby was created before its try existed, so its metadata cannot carry the try's UUID: the
driver remembers which sandbox each request took (``fence`` deletes it by id), and writes the
request's id and labels into the standby (:data:`REQUEST_PATH`) before the try starts, so a
scheduler that never saw the launch (a restart, another scheduler) still finds it by reading
that file (``fence`` of an unknown request, ``list_requests``). What a task writes there can
only point a fence or the orphan sweep at its own sandbox.

Reading that file is activity, which resets a waiting standby's idle TTL: so standbys also carry
their owner (this driver's instance, and what the executor adds: its scheduler job), and the sweep
reads only the standbys of owners its owner check calls gone, deleting their idle ones.

The lifecycle pieces are the core's (``pandastack_jobs``): a detached job (create with
TTL and metadata, launch in the background, poll one exit marker), failure
classification with the capacity ``Retry-After``, idempotent delete and the
metadata sweep. This module only translates them to the contract.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import pandastack

from airflow_provider.exceptions import PandaStackAirflowError
from pandastack_jobs import (
    ConnectionConfig,
    DetachedJob,
    Engine,
    FailureKind,
    JobKey,
    JobOutcome,
    JobSpec,
    Redactor,
    SandboxGone,
    Standby,
    WarmStart,
    delete_sandbox,
    guest,
    poll_detached,
    start_detached,
    sweep,
)
from pandastack_jobs.failures import describe_exit
from pandastack_jobs.spec import DEFAULT_TEMPLATE
from pandastack_jobs.warm_start import STANDBY_LABEL

from .contract import SandboxDriver, SandboxDriverFactory
from .models import (
    SandboxCapacityError,
    SandboxHandle,
    SandboxInvalidHandleError,
    SandboxLaunchRequest,
    SandboxOutput,
    SandboxResult,
    SandboxState,
)
from .warm import PoolFactory, WarmPools

__all__ = [
    "OWNER_INSTANCE",
    "REQUEST_LABEL",
    "OwnerCheck",
    "PandaStackDriver",
    "SandboxDriver",
    "SandboxDriverFactory",
    "SandboxLaunchError",
]

logger = logging.getLogger(__name__)

# Sandbox metadata key carrying the task try's pre-assigned UUID (fence and recover look for it).
REQUEST_LABEL = "airflow_ti_uuid"
ENGINE = Engine.AIRFLOW_EXECUTOR
OUTPUT_TAIL_BYTES = 16 * 1024
# The launch request's labels, as the core's job key writes them on the sandbox's metadata.
LABEL_KEYS = {
    "dag_id": "job_workflow",
    "task_id": "job_task",
    "run_id": "job_run",
    "map_index": "job_map_index",
    "try_number": "job_try",
}
# Written into each sandbox before the task starts: the task can tell which sandbox it runs in.
SANDBOX_ID_PATH = f"{guest.DETACHED_DIR}/sandbox_id"
# Written into a standby when a try takes it: {"request_id": ..., "labels": {...}} (JSON).
REQUEST_PATH = f"{guest.DETACHED_DIR}/airflow_request.json"
REQUEST_FILE_LIMIT = 4096
# Its first REQUEST_FILE_LIMIT bytes, opened O_NONBLOCK: the try owns the file and may swap in a
# FIFO, on which `head` blocked until the client's 30 s timeout (per such standby, per sweep).
REQUEST_READ = (
    f"dd if={REQUEST_PATH} bs={REQUEST_FILE_LIMIT} count={REQUEST_FILE_LIMIT} "
    "iflag=count_bytes,nonblock status=none 2>/dev/null"
)
# Standby metadata: the driver that made it (it never reads its own: its pool knows them).
OWNER_INSTANCE = "airflow_executor_instance"
OwnerCheck = Callable[[Sequence[Mapping[str, str]]], Sequence[bool | None]]
"""For each standby's metadata: is its owner alive (True), gone (False) or unknown (None)?"""


def _read_request(sb: Any) -> str | None:
    """A standby's request file, bounded and non-blocking: "" when it has none (idle), None when
    the sandbox could not be asked."""
    try:
        res = sb.exec(REQUEST_READ, timeout_seconds=30)
    except pandastack.PandastackError:
        return None  # gone, or not answering: the standby's TTL is its backstop
    return (res.stdout or "")[:REQUEST_FILE_LIMIT]


def _claim(text: str | None) -> tuple[str, dict[str, str]] | None:
    """The (request id, labels) a request file names; None when it is not a try's file we can decode."""
    try:
        body = json.loads(text or "null")
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict) or not isinstance(body.get("request_id"), str):
        return None
    labels = body.get("labels")
    labels = labels if isinstance(labels, dict) else {}
    return body["request_id"], {k: str(labels.get(k, "")) for k in LABEL_KEYS}


class SandboxLaunchError(PandaStackAirflowError, RuntimeError):
    """The sandbox could not be started; the message says why (already redacted)."""


class PandaStackDriver(SandboxDriver):
    """Runs each task try as a detached job of the core in its own PandaStack sandbox.

    The API key stays in this process: the sandbox gets the request's argv and env only.
    ``owners_alive`` tells the sweep whose standbys it may read and delete (without one, none).
    """

    driver_id: ClassVar[str] = "pandastack"

    def __init__(
        self,
        connection: ConnectionConfig,
        *,
        redactor: Redactor | None = None,
        owners_alive: OwnerCheck | None = None,
    ) -> None:
        self._connection = connection
        self._redact = redactor or Redactor()
        self._redact.add(connection.api_key)
        self.owners_alive = owners_alive
        self.instance = uuid.uuid4().hex
        self._warm: WarmPools | None = None
        # request id -> the standby its launch took (None: none, or not yet), for fence and
        # terminate; a cold try leaves once launched (its metadata carries the request id).
        self._launched: dict[str, str | None] = {}

    def open_standbys(
        self,
        warms: Sequence[WarmStart],
        size: int,
        *,
        owner: Mapping[str, str] | None = None,
        pool_factory: PoolFactory | None = None,
    ) -> list[str]:
        """Start one standby pool per warm key (``size`` ready standbys each); their keys.

        ``owner``: metadata by which other schedulers' owner check tells whether this one lives.
        Called by the executor's ``start``, never for the short-lived drivers of a log read.
        """
        if size <= 0 or self._warm is not None:
            return [] if self._warm is None else self._warm.keys
        extra = {} if pool_factory is None else {"pool_factory": pool_factory}
        metadata = {**(owner or {}), "job_engine": ENGINE, OWNER_INSTANCE: self.instance}
        pools = WarmPools(self._client, warms, size, metadata=metadata, redactor=self._redact, **extra)
        pools.start()
        self._warm = pools
        return pools.keys

    def _client(self) -> pandastack.Client:
        # One client per call: the core records capacity refusals per thread and client.
        client = self._connection.client()
        self._redact.add(client.api_key)
        return client

    async def health_check(self) -> None:
        await asyncio.to_thread(lambda: self._client().sandboxes.list())

    # -- launch ----------------------------------------------------------------------------------

    def spec_for(self, request: SandboxLaunchRequest) -> JobSpec:
        """The core job for one task try: the argv, detached, tagged with the try's UUID."""
        labels = request.provider_config.get("labels") or {}
        key = None
        if {"dag_id", "task_id", "run_id"} <= set(labels):
            key = JobKey(
                engine=ENGINE,
                workflow=labels["dag_id"],
                task=labels["task_id"],
                run=labels["run_id"],
                map_index=int(labels.get("map_index", "-1")),
                try_number=int(labels.get("try_number", "1")),
            )
        return JobSpec(
            command=shlex.join(request.command),
            template=request.provider_config.get("template", DEFAULT_TEMPLATE),
            timeout=request.timeout_seconds,
            ttl=request.ttl_seconds,
            env=request.env,
            result_path=None,
            metadata={REQUEST_LABEL: request.request_id},
            key=key,
        )

    def _take_standby(self, request: SandboxLaunchRequest) -> Standby | None:
        if self._warm is None:
            return None
        template = request.provider_config.get("template", DEFAULT_TEMPLATE)
        try:
            return self._warm.take(template, request.command, request.env)
        except Exception:  # a pool in trouble never stops a try: it goes cold
            logger.warning(
                "could not take a standby for %s; launching cold", request.request_id, exc_info=True
            )
            return None

    def _launch(self, request: SandboxLaunchRequest) -> SandboxHandle:
        client = self._client()
        self._launched.setdefault(request.request_id, None)
        standby = self._take_standby(request)
        if standby is not None:
            self._launched[request.request_id] = standby.sandbox_id  # fenced by id from here on
        labels = request.provider_config.get("labels") or {}

        def tell_the_sandbox_its_id(sandbox_id: str) -> None:
            files = client.sandboxes.get(sandbox_id).filesystem
            files.write(SANDBOX_ID_PATH, sandbox_id.encode())
            if standby is not None and sandbox_id == standby.sandbox_id:
                body = {"request_id": request.request_id, "labels": dict(labels)}
                files.write(REQUEST_PATH, json.dumps(body).encode())

        warm: dict[str, Any] = {}
        if standby is not None:
            warm = {"standby": standby, "standby_command": standby.command(list(request.command))}
        started = start_detached(
            client, self.spec_for(request), redactor=self._redact, on_created=tell_the_sandbox_its_id, **warm
        )
        if isinstance(started, JobOutcome):
            if started.kind is FailureKind.CAPACITY:
                raise SandboxCapacityError(started.reason, started.retry_after or 1.0)
            raise SandboxLaunchError(f"sandbox launch failed ({started.kind}): {started.reason}")
        data = started.to_dict()
        if standby is not None and started.sandbox_id == standby.sandbox_id:
            data["standby"] = standby.warm.key()  # this try ran warm (the bench and tests read it)
        else:  # a cold sandbox (also a standby found gone): its metadata names the request
            self._launched.pop(request.request_id, None)
        return SandboxHandle(data, display_name=started.sandbox_id)

    async def launch(self, request: SandboxLaunchRequest) -> SandboxHandle:
        return await asyncio.to_thread(self._launch, request)

    def validate_handle(self, handle: SandboxHandle, *, request_id: str) -> None:
        try:
            DetachedJob.from_dict(dict(handle.data))
        except (KeyError, TypeError, ValueError) as exc:
            raise SandboxInvalidHandleError(
                f"handle of request {request_id} is not a PandaStack detached job: {exc!r}"
            ) from None

    # -- observe ---------------------------------------------------------------------------------

    def _status(self, handle: SandboxHandle) -> SandboxResult:
        job = DetachedJob.from_dict(dict(handle.data))
        try:
            code = poll_detached(self._client(), job.sandbox_id)
        except SandboxGone as exc:
            return SandboxResult(SandboxState.GONE, message=self._redact(f"sandbox lost: {exc}"))
        if code is None:
            if time.time() > job.deadline:
                return SandboxResult(
                    SandboxState.FAILED,
                    message=f"the task did not finish within its {job.timeout:g}s sandbox timeout",
                )
            return SandboxResult(SandboxState.RUNNING)
        if code == 0:
            return SandboxResult(SandboxState.SUCCEEDED, exit_code=0)
        elapsed = time.time() - job.started_at
        if guest.timed_out(code, elapsed, job.timeout):
            message = f"the task exceeded its {job.timeout:g}s sandbox timeout and was killed"
        else:
            message = f"the task's sandbox workload ended with {describe_exit(code)}"
        return SandboxResult(SandboxState.FAILED, exit_code=code, message=message)

    async def get_status(self, handle: SandboxHandle) -> SandboxResult:
        return await asyncio.to_thread(self._status, handle)

    def _output(self, handle: SandboxHandle) -> SandboxOutput | None:
        job = DetachedJob.from_dict(dict(handle.data))
        client = self._client()
        try:
            sb = client.sandboxes.get(job.sandbox_id)
            # tail -c bounds what crosses the wall, whatever the job printed.
            res = sb.exec(
                f"tail -c {OUTPUT_TAIL_BYTES} {guest.DETACHED_STDOUT}; "
                f"tail -c {OUTPUT_TAIL_BYTES} {guest.DETACHED_STDERR} >&2; "
                f"wc -c < {guest.DETACHED_STDOUT} >&2",
                timeout_seconds=30,
            )
        except pandastack.NotFoundError:
            return None
        stderr, _, size_line = (res.stderr or "").rstrip("\n").rpartition("\n")
        truncated = not size_line.strip().isdigit() or int(size_line.strip()) > OUTPUT_TAIL_BYTES
        return SandboxOutput(
            stdout=self._redact((res.stdout or "")[-OUTPUT_TAIL_BYTES:]),
            stderr=self._redact(stderr[-OUTPUT_TAIL_BYTES:]),
            truncated=truncated,
        )

    async def get_output(self, handle: SandboxHandle) -> SandboxOutput | None:
        return await asyncio.to_thread(self._output, handle)

    def _read_file(self, handle: SandboxHandle, path: str, limit: int) -> bytes | None:
        job = DetachedJob.from_dict(dict(handle.data))
        client = self._client()
        try:
            sb = client.sandboxes.get(job.sandbox_id)
            info = sb.filesystem.stat(path)
            if info.is_dir:
                return None
            if info.size > limit:
                res = sb.exec(f"tail -c {limit} {shlex.quote(path)}", timeout_seconds=30)
                return (res.stdout or "").encode()[-limit:]
            return sb.filesystem.read(path)[-limit:]
        except pandastack.NotFoundError:
            return None

    async def read_file(self, handle: SandboxHandle, path: str, limit: int) -> bytes | None:
        """The last ``limit`` bytes of a file in the sandbox (the task's log), or None if absent.

        PandaStack-specific: ``common.sandbox`` expects remote logging instead.
        """
        return await asyncio.to_thread(self._read_file, handle, path, limit)

    def _list_requests(self) -> dict[str, dict[str, str]]:
        found: dict[str, dict[str, str]] = {}
        client = self._client()
        listing = client.sandboxes.list()
        for sb in listing:
            meta = sb.metadata or {}
            request_id = meta.get(REQUEST_LABEL)
            if meta.get("job_engine") == ENGINE and isinstance(request_id, str) and request_id:
                found.setdefault(
                    request_id, {label: str(meta.get(key, "")) for label, key in LABEL_KEYS.items()}
                )
        for request_id, claims in self._standby_tries(client, listing).items():
            found.setdefault(request_id, claims[0][1])
        return found

    def _standby_tries(
        self, client: pandastack.Client, listing: Any, *, every_owner: bool = False
    ) -> dict[str, list[tuple[str, dict[str, str]]]]:
        """Taken standbys of other drivers: request id -> every (sandbox id, the try's labels)
        whose request file names it, read (bounded) from the file the launching driver wrote.

        A read resets the standby's idle TTL, so the sweep reads only a gone owner's standbys, and
        deletes the idle ones (no file: no try started there); a live owner's tries are its own, an
        unknown owner's standbys are left to their TTL. A fence (``every_owner``) reads every other
        owner's: it must find each claimant of its request. This driver's own are never read.

        The file sits in the try's own sandbox, so the try can rewrite it: a forged request id
        must not hide the real claimant from the fence (every claimant is listed and fenced, the
        forger only fences itself), and a body that is not JSON we can decode (a 4 KiB ``[[[``
        raises RecursionError) is skipped, not raised into the orphan sweep or the fence."""
        standbys = [sb for sb in listing if self._others_standby(sb.metadata or {})]
        found: dict[str, list[tuple[str, dict[str, str]]]] = {}
        idle: list[str] = []
        for sb, alive in zip(standbys, self._owners(standbys), strict=True):
            if alive is not False and not every_owner:
                continue
            text = _read_request(sb)
            if text == "" and alive is False:
                idle.append(sb.id)
            claim = _claim(text)
            if claim is not None:
                found.setdefault(claim[0], []).append((sb.id, claim[1]))
        deleted = [sandbox_id for sandbox_id in idle if delete_sandbox(client, sandbox_id)]
        if deleted:
            logger.info("deleted %d idle standby(s) of gone scheduler(s): %s", len(deleted), deleted)
        return found

    def _others_standby(self, meta: Mapping[str, Any]) -> bool:
        """A standby of this engine that another driver made (what this one made, waiting or
        taken by its tries, its pool and ``_launched`` know)."""
        return (
            STANDBY_LABEL in meta
            and meta.get("job_engine") == ENGINE
            and meta.get(OWNER_INSTANCE) != self.instance
        )

    def _owners(self, standbys: Sequence[Any]) -> list[bool | None]:
        """``owners_alive`` of each standby; all unknown without a check, or when it fails."""
        if self.owners_alive is None or not standbys:
            return [None] * len(standbys)
        try:
            alive = list(self.owners_alive([dict(sb.metadata or {}) for sb in standbys]))
        except Exception:  # the DB down: no standby deleted, none read by the sweep
            logger.warning("could not tell whether the standbys' owners live", exc_info=True)
            return [None] * len(standbys)
        return alive if len(alive) == len(standbys) else [None] * len(standbys)

    async def list_requests(self) -> dict[str, dict[str, str]]:
        """The live sandboxes this executor made, by request id: the try's labels (dag_id, task_id,
        run_id, map_index, try_number, as the core's job key put them on the metadata).

        PandaStack-specific (``common.sandbox`` has no listing): the orphan sweep's input. On the
        way it deletes the idle standbys of schedulers ``owners_alive`` calls gone.
        """
        return await asyncio.to_thread(self._list_requests)

    # -- stop ------------------------------------------------------------------------------------

    async def terminate(self, handle: SandboxHandle) -> None:
        job = DetachedJob.from_dict(dict(handle.data))
        await asyncio.to_thread(lambda: delete_sandbox(self._client(), job.sandbox_id, raise_errors=True))
        for request_id, sandbox_id in list(self._launched.items()):
            if sandbox_id == job.sandbox_id:
                self._launched.pop(request_id, None)

    def _fence(self, request_id: str) -> list[str]:
        client = self._client()

        def ours(meta: Any) -> bool:
            return bool(meta.get(REQUEST_LABEL) == request_id)

        deleted = sweep(client, ours)
        if request_id in self._launched:
            by_id = {self._launched[request_id]} - {None}  # the standby it took, if any
        else:  # launched by a scheduler before this one: it may run in a taken standby
            tries = self._standby_tries(client, client.sandboxes.list(), every_owner=True)
            by_id = {sandbox_id for sandbox_id, _ in tries.get(request_id, [])}
        for sandbox_id in sorted(str(s) for s in by_id):
            if delete_sandbox(client, sandbox_id, raise_errors=True) and sandbox_id not in deleted:
                deleted.append(sandbox_id)
        listing = client.sandboxes.list()
        left = [sb.id for sb in listing if ours(sb.metadata or {}) or sb.id in by_id]
        if left:
            raise SandboxLaunchError(f"could not delete sandbox(es) {left} of request {request_id}; retrying")
        self._launched.pop(request_id, None)
        if deleted:
            logger.info("fenced request %s: deleted %s", request_id, deleted)
        return deleted

    async def fence(self, request_id: str) -> None:
        await asyncio.to_thread(self._fence, request_id)

    async def close(self) -> None:
        """Close the standby pools: their untaken standbys are deleted (a taken one ends with its try)."""
        warm, self._warm = self._warm, None
        if warm is not None:
            await asyncio.to_thread(warm.close)
