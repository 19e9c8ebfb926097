"""Chunks for tiny jobs: up to K messages of one isolation key run one after another in one sandbox.

A sandbox's start can cost more than a tiny job, so a chunk pays it once for
several messages. Each mate still gets the rails :func:`~pandastack_jobs.run_job`
gives, from the same :class:`~pandastack_jobs.lifecycle.JobRun` steps: its own
work directory, its own guest-side timeout, its own size-checked result, and its
own outcome (so its own ack, redelivery or dead letter). What a chunk gives up is
the wall between its mates: they share one sandbox, so a mate can see what an
earlier mate left. That is why a chunk never mixes isolation keys (tenants) nor
job options (template, resources, env: the sandbox is made for one set).
"""

from __future__ import annotations

import json
import logging
import shlex
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from typing import TypeVar

import pandastack
from pandastack import Sandbox

from ..lifecycle import JobHandle, JobRun, _sandbox_exists, reap_before
from ..outcome import FailureClass, FailureKind, JobOutcome
from ..reaper import delete_sandbox, is_earlier_try, reap_best_effort
from ..spec import WORKDIR, JobKey, JobSpec
from .message import QueueJob

logger = logging.getLogger(__name__)

T = TypeVar("T")
CHUNK_DIR = f"{WORKDIR}/.chunk"
# A run of one mate: ``run()`` is the JobRun call; the wrapper (an engine's task run) returns it.
MateWrapper = Callable[[int, Callable[[], JobOutcome]], JobOutcome]
MateFinished = Callable[[int, JobOutcome], None]


def check_key(name: str) -> str:
    """Validate a chunk key name: ``tenant`` (the message's field) or ``input.<name>``."""
    if name == "tenant" or (name.startswith("input.") and len(name) > len("input.")):
        return name
    raise ValueError(f"chunk key {name!r} is neither 'tenant' nor 'input.<name>' (a field of the input)")


def isolation_key(job: QueueJob, name: str) -> str | None:
    """The value of the chunk key ``name`` in ``job``, or None when the message has none.

    Only a non-empty string counts: a number, an object or a missing field never
    lets a message share a sandbox by accident.
    """
    if name == "tenant":
        return job.tenant
    value = job.input.get(name[len("input.") :]) if isinstance(job.input, dict) else None
    return value if isinstance(value, str) and value else None


def group_of(job: QueueJob, name: str, keyless: bool) -> Hashable | None:
    """What must be equal for two messages to share a sandbox: the isolation key and every job
    option (template, timeout, env, ...). None: the message runs alone."""
    key = isolation_key(job, name)
    if key is None and not keyless:
        return None
    return (key, json.dumps(job.options, sort_keys=True, default=repr))


def plan(items: Sequence[T], group: Callable[[T], Hashable | None], size: int, slots: int) -> list[list[T]]:
    """Split ``items`` (in arrival order) into at most ``slots`` chunks of up to ``size`` items.

    Items of one group fill a chunk in order; an item whose group is None gets a
    chunk of its own. Chunks are ordered by their first item, so nothing waits
    behind later arrivals; what does not fit into ``slots`` chunks is left out
    (the caller keeps it for the next free slot).
    """
    chunks: list[list[T]] = []
    open_chunk: dict[Hashable, list[T]] = {}
    for item in items:
        g = group(item)
        if g is not None and g in open_chunk:
            chunk = open_chunk[g]
        else:
            chunk = []
            chunks.append(chunk)
            if g is not None:
                open_chunk[g] = chunk
        chunk.append(item)
        if g is not None and len(chunk) >= size:
            del open_chunk[g]
    return chunks[:slots]


def mate_label(key: JobKey) -> str:
    """The metadata key that names ``key``'s job as a mate of a chunk's sandbox (its value: the
    try). Every mate's key is on the sandbox, not only the first's: when a worker dies mid-chunk
    after the first mate was acked, only the later mates come back, and they must find it."""
    return f"queue_chunk_job_{key.job_id}"


def reap_chunks_before(client: pandastack.Client, spec: JobSpec) -> list[str]:
    """Delete the chunk sandboxes an earlier delivery of ``spec``'s message ran in as a mate (a
    worker killed mid-chunk), before this delivery runs. Best effort, as
    :func:`~pandastack_jobs.lifecycle.reap_before`: both are
    :func:`~pandastack_jobs.reaper.reap_best_effort`."""
    key = spec.key
    if key is None or key.try_number <= 1:
        return []
    label = mate_label(key)
    try_number = key.try_number
    return reap_best_effort(
        client,
        lambda meta: label in meta and is_earlier_try(meta[label], try_number),
        "chunk sandboxes of earlier deliveries",
    )


def mate_workdir(index: int) -> str:
    """The work directory of the chunk's ``index``-th mate."""
    return f"{CHUNK_DIR}/{index}"


def rebase(spec: JobSpec, workdir: str) -> JobSpec:
    """``spec`` with every path under ``/work`` (its files, result and collected paths) moved
    under ``workdir``: the mate's own directory. Absolute paths elsewhere are left as they are.

    The command first removes whatever is at its result and collected paths (unless it was
    delivered there): an earlier mate can write into this mate's directory, and what it left
    must never be read back as this mate's result. (A process it left running can still write
    it meanwhile: mates share a sandbox, so they must trust each other; docs/queues.md.)
    """

    def move(path: str) -> str:
        if path == WORKDIR or path.startswith(WORKDIR + "/"):
            return workdir + path[len(WORKDIR) :]
        return path

    files = {move(p): c for p, c in spec.files.items()}
    result_path = move(spec.result_path) if spec.result_path is not None else None
    collect = tuple(move(p) for p in spec.collect)
    stale = [p for p in (result_path, *collect) if p is not None and p not in files]
    command = spec.command
    if stale:
        command = f"rm -rf -- {' '.join(shlex.quote(p) for p in stale)} && {command}"
    return replace(spec, command=command, files=files, result_path=result_path, collect=collect)


class _Mate(JobRun):
    """One mate's run: the JobRun steps, but the sandbox is the chunk's (deleted by run_chunk)."""

    def teardown(self) -> str | None:
        return None


def _lost(spec: JobSpec, sandbox_id: str | None, reason: str, tail: JobOutcome | None = None) -> JobOutcome:
    key = spec.key
    return JobOutcome(
        ok=False,
        kind=FailureKind.SANDBOX_LOST,
        failure_class=FailureClass.REDELIVER,
        reason=reason,
        sandbox_id=sandbox_id,
        stdout_tail=tail.stdout_tail if tail else "",
        stderr_tail=tail.stderr_tail if tail else "",
        exit_code=tail.exit_code if tail else None,
        job_id=key.job_id if key else None,
        try_number=key.try_number if key else None,
    )


def run_chunk(
    client: pandastack.Client,
    specs: Sequence[JobSpec],
    *,
    handles: Sequence[JobHandle] | None = None,
    wrap: MateWrapper | None = None,
    on_finished: MateFinished | None = None,
) -> list[JobOutcome]:
    """Run ``specs`` one after another in one fresh sandbox; return one outcome per spec.

    The sandbox is made from the first spec (template, TTL, metadata naming its
    attempt) and labelled with every mate's key (:func:`mate_label`), so a
    redelivery of any mate reaps it after a worker's SIGKILL; it is deleted at the
    end, always. A mate that fails does not touch the others.
    If the sandbox itself is gone after a mate fails (OOM kill, TTL, deleted
    under it), that mate and every mate not yet run end as ``SANDBOX_LOST``
    (redeliver): none of them is to blame. ``on_finished(i, outcome)`` is called
    as each mate ends, the last one only after the sandbox is deleted (so a caller
    that starts the next chunk then never has more sandboxes alive than slots).
    """
    if not specs:
        return []
    n = len(specs)
    handles = list(handles) if handles is not None else [JobHandle() for _ in specs]
    outcomes: list[JobOutcome | None] = [None] * n
    first = specs[0]
    labels = {mate_label(s.key): str(s.key.try_number) for s in specs if s.key is not None}
    meta = {**first.metadata, **labels, "queue_chunk_size": str(n)}
    owner = JobRun(client, replace(first, metadata=meta))
    sandbox: Sandbox | None = None
    lost: str | None = None

    def finish(i: int, outcome: JobOutcome) -> None:
        outcomes[i] = outcome
        if on_finished is not None and i < n - 1:
            on_finished(i, outcome)

    try:
        for spec in specs:
            if spec.key is not None and spec.key.try_number > 1:
                reap_before(client, spec)
                reap_chunks_before(client, spec)
        for i, spec in enumerate(specs):
            if lost is not None:
                finish(i, _lost(spec, sandbox.id if sandbox else None, lost))
                continue
            if handles[i].cancelled:
                finish(
                    i,
                    replace(_lost(spec, None, "job was cancelled before it ran"), kind=FailureKind.CANCELLED),
                )
                continue
            workdir = mate_workdir(i)
            mate = _Mate(client, rebase(spec, workdir), handle=handles[i], workdir=workdir)
            acquire = owner.create if sandbox is None else _given(sandbox)
            run = _runner(mate, acquire)
            try:
                outcome = wrap(i, run) if wrap is not None else run()
            except Exception as exc:
                # Unclassified (an SDK error the lifecycle does not know): if the sandbox is gone,
                # it is the chunk's death, not this mate's fault; otherwise let it propagate.
                gone = sandbox or mate.sandbox
                if gone is None or _sandbox_exists(client, gone.id):
                    raise
                sandbox = gone
                outcome = JobOutcome(
                    ok=False, kind=FailureKind.SANDBOX_LOST, reason=f"{type(exc).__name__}: {exc}"
                )
            if sandbox is None and mate.sandbox is None:
                # The create failed (capacity, unknown template): every mate shares that fate.
                for j in range(i, n):
                    key = specs[j].key
                    finish(
                        j,
                        replace(
                            outcome,
                            job_id=key.job_id if key else None,
                            try_number=key.try_number if key else None,
                        ),
                    )
                break
            sandbox = sandbox or mate.sandbox
            assert sandbox is not None
            if not outcome.ok and (
                outcome.kind is FailureKind.SANDBOX_LOST or not _sandbox_exists(client, sandbox.id)
            ):
                lost = (
                    f"the chunk's sandbox {sandbox.id} died while mate {i + 1}/{n} ran "
                    f"({outcome.kind.value if outcome.kind else '?'}: {outcome.reason})"
                )
                logger.warning("%s; releasing the %d unfinished mate(s)", lost, n - i)
                outcome = _lost(spec, sandbox.id, lost, outcome)
            finish(i, outcome)
    finally:
        if sandbox is not None:
            delete_sandbox(client, sandbox.id)
    last = outcomes[-1]
    if on_finished is not None and last is not None:
        on_finished(n - 1, last)
    return [o for o in outcomes if o is not None]


def _given(sandbox: Sandbox) -> Callable[[], Sandbox]:
    return lambda: sandbox


def _runner(mate: JobRun, acquire: Callable[[], Sandbox]) -> Callable[[], JobOutcome]:
    return lambda: mate.run(acquire=acquire)


__all__ = [
    "check_key",
    "group_of",
    "isolation_key",
    "mate_label",
    "mate_workdir",
    "plan",
    "reap_chunks_before",
    "rebase",
    "run_chunk",
]
