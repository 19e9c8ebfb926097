"""Orphans: tries that ended while no scheduler watched them.

A scheduler SIGKILLed while a try runs: if the try finishes before a new scheduler comes,
its TI is no longer queued or running, nobody adopts it, and its sandbox (kept after the
exit so the log can be copied) would wait for its TTL. Every ``orphan_sweep_interval`` the
sweep lists this executor's sandboxes (the driver's ``list_requests``, a PandaStack
extension: ``common.sandbox`` has no listing), looks their tries up in the metadata DB and,
for a try that ended more than ``ORPHAN_GRACE_SECONDS`` ago, copies the task log out and
fences its request id. A try the DB does not know as ours (another deployment sharing the
account) is left alone: the TTL is its backstop.

Standbys (warm starts) name the scheduler job their executor runs in (:func:`scheduler_owner`):
the driver's sweep asks :func:`owners_alive` which owners are gone, reads only their standbys
(finding their tries) and deletes their idle ones, which would otherwise never reach their idle
TTL (a read is activity).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Future
from datetime import datetime, timedelta, timezone
from typing import Any

from .contract import SandboxDriver
from .models import SandboxExecutionRef
from .task_logs import TaskLogRelay

# The sweep leaves a finished try's sandbox this long to the executor that owns it
# (another scheduler of an HA pair deletes it within a poll or two of the end).
ORPHAN_GRACE_SECONDS = 60.0

# A standby's metadata: the scheduler job its executor runs in, and when that job started (the
# start tells this DB's job from another deployment's job with the same id).
OWNER_JOB = "airflow_scheduler_job"
OWNER_STARTED = "airflow_scheduler_started"
# A running scheduler job is gone only once it has been silent this long too (whatever Airflow's
# health threshold): a loaded scheduler's heartbeat lags, and a gone owner's idle standbys are deleted.
OWNER_SILENCE_SECONDS = 60.0

Submit = Callable[[Coroutine[Any, Any, Any]], "Future[Any]"]
Listing = dict[str, dict[str, str]]


def ended_tries(
    candidates: Listing, driver_id: str, grace: float = ORPHAN_GRACE_SECONDS
) -> dict[str, SandboxExecutionRef | None]:
    """Of the ``candidates`` (request id -> the try's labels), the tries the metadata DB shows
    ended before the grace, with the handle their TI stored: request id -> ref.

    A try is found by its task instance key and try number, and is ours only if the row's
    ``external_executor_id`` is the request id or a ref to it.
    """
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.taskinstancehistory import TaskInstanceHistory
    from airflow.utils.session import create_session
    from airflow.utils.state import State
    from sqlalchemy import select, tuple_

    wanted: dict[tuple[str, str, str, int, int], list[str]] = {}
    for request_id, labels in candidates.items():
        try:
            key = (labels["dag_id"], labels["task_id"], labels["run_id"], int(labels["map_index"]))
            wanted.setdefault((*key, int(labels["try_number"])), []).append(request_id)
        except (KeyError, ValueError):
            continue  # clipped or foreign metadata: the TTL is its backstop
    if not wanted:
        return {}
    cutoff = datetime.now(timezone.utc) - timedelta(seconds=grace)
    rows: list[tuple[Any, ...]] = []
    with create_session() as session:
        for model, is_current in ((TaskInstance, True), (TaskInstanceHistory, False)):
            cols = (model.dag_id, model.task_id, model.run_id, model.map_index)
            query = select(*cols, model.try_number, model.state, model.end_date, model.external_executor_id)
            query = query.where(tuple_(*cols).in_(sorted({k[:4] for k in wanted})))
            rows += [(*row, is_current) for row in session.execute(query).all()]
    ended: dict[str, SandboxExecutionRef | None] = {}
    for dag_id, task_id, run_id, map_index, try_number, state, end_date, external, current in rows:
        running = current and state not in State.finished
        if running or (end_date is not None and end_date >= cutoff):
            continue
        ref = SandboxExecutionRef.decode(external, expected_driver=driver_id)
        for found in wanted.get((dag_id, task_id, run_id, map_index, try_number), []):
            # Only the request this row names (not another deployment's try with the same names).
            if external == found or (ref is not None and ref.request_id == found):
                ended[found] = ref
    return ended


def scheduler_owner(job_id: int | str | None) -> dict[str, str]:
    """The standby metadata naming scheduler job ``job_id`` (its id and start); {} without a job."""
    if job_id is None:
        return {}
    from airflow.jobs.job import Job
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        started = session.scalar(select(Job.start_date).where(Job.id == int(job_id)))
    return {} if started is None else {OWNER_JOB: str(job_id), OWNER_STARTED: started.isoformat()}


def owners_alive(metadata: Sequence[Mapping[str, str]]) -> list[bool | None]:
    """For each standby's metadata: is its scheduler job alive (True), gone (False: ended, or
    silent past Airflow's health threshold and :data:`OWNER_SILENCE_SECONDS`), or unknown here
    (None: no owner named, or no job of that id and start in this DB)?"""
    from airflow.jobs.job import Job, JobState
    from airflow.utils.session import create_session
    from sqlalchemy import select

    owners = [_owner(meta) for meta in metadata]
    ids = {job_id for job_id, _ in filter(None, owners)}
    state: dict[tuple[int, str], bool] = {}
    if ids:
        cutoff = datetime.now(timezone.utc) - timedelta(seconds=OWNER_SILENCE_SECONDS)
        with create_session() as session:
            for job in session.scalars(select(Job).where(Job.id.in_(sorted(ids)))):
                silent = job.latest_heartbeat is None or job.latest_heartbeat < cutoff
                gone = not job.is_alive() and (job.state != JobState.RUNNING or silent)
                if job.start_date is not None:
                    state[(job.id, job.start_date.isoformat())] = not gone
    return [None if owner is None else state.get(owner) for owner in owners]


def _owner(meta: Mapping[str, str]) -> tuple[int, str] | None:
    job_id, started = meta.get(OWNER_JOB), meta.get(OWNER_STARTED)
    if not isinstance(job_id, str) or not isinstance(started, str) or not job_id.isascii():
        return None  # none named (made before owners were), or not ours to parse: unknown
    if not job_id.isdigit() or len(job_id) > 18:  # a DB's integer id
        return None
    return int(job_id), started


class OrphanSweep:
    """The sweep's own state between heartbeats: one listing in flight, then one collect per orphan."""

    def __init__(self, interval: float, driver_id: str, relay: TaskLogRelay, log: Any) -> None:
        self.interval, self.driver_id, self.relay, self.log = interval, driver_id, relay, log
        self.ended_tries: Callable[[Listing], dict[str, SandboxExecutionRef | None]] = lambda candidates: (
            ended_tries(candidates, self.driver_id)
        )
        """The metadata-DB lookup (the one seam a unit test replaces)."""
        self.next_sweep = 0.0  # the first heartbeat sweeps: a restarted scheduler cleans up at once
        self.clock: Callable[[], float] = time.monotonic
        """When a sweep is due: the executor hands its own (a test's skips waits)."""
        self._listing: Future[Listing] | None = None
        self.collecting: dict[Future[bytes | None], tuple[str, SandboxExecutionRef | None]] = {}

    @property
    def requests(self) -> set[str]:
        """The request ids being collected now (owned by the sweep until their fence holds)."""
        return {request_id for request_id, _ in self.collecting.values()}

    def tick(self, driver: SandboxDriver, submit: Submit, owned: Callable[[], set[str]]) -> None:
        """One heartbeat: start a listing when due, or turn a finished one into collects."""
        list_requests = getattr(driver, "list_requests", None)
        if self.interval <= 0 or list_requests is None:
            return
        if self._listing is None:
            if self.clock() >= self.next_sweep:
                self._listing = submit(list_requests())
            return
        if not self._listing.done():
            return
        listing, self._listing = self._listing, None
        self.next_sweep = self.clock() + self.interval
        try:
            taken = owned()
            candidates = {r: labels for r, labels in listing.result().items() if r not in taken}
            ended = self.ended_tries(candidates) if candidates else {}
        except Exception:  # the next sweep tries again
            self.log.warning("PandaStackExecutor: orphan sweep failed", exc_info=True)
            return
        for request_id, ref in ended.items():
            self.log.info(
                "PandaStackExecutor: try %s ended without an owner; deleting its sandbox", request_id
            )
            self.collecting[submit(self._collect(driver, request_id, ref))] = (request_id, ref)

    async def _collect(
        self, driver: SandboxDriver, request_id: str, ref: SandboxExecutionRef | None
    ) -> bytes | None:
        """An orphan's task log (when its handle was persisted), then fence its UUID."""
        log = await self.relay.read(driver, ref) if ref is not None else None
        await driver.fence(request_id)
        return log

    def drain(self) -> None:
        for future, (request_id, ref) in list(self.collecting.items()):
            if not future.done():
                continue
            del self.collecting[future]
            try:
                log = future.result()
            except Exception:  # still listed: the next sweep tries again
                self.log.warning("PandaStackExecutor: deleting orphan %s failed", request_id, exc_info=True)
                continue
            if ref is not None and log is not None:
                self.relay.write(ref.handle.data.get("log_path"), log, [])
