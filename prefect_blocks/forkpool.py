"""Warm-fork pools in flows: warm one parent once, run every job in its own fork.

``warm_pool(...)`` is a context manager for the flow body: it creates the
parent sandbox, runs the expensive warm-up in it once, yields a
:class:`WarmParent` to pass to tasks, and deletes the parent (and any fork a
crashed job left) when the block exits, even if jobs failed.
``run_in_fork`` is a task: one job in a fresh fork of the parent, deleted
afterwards, retried as redelivery like :func:`~prefect_blocks.run_in_sandbox`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

from prefect import task
from typing_extensions import Unpack

from pandastack_jobs import DEFAULT_PARENT_TTL, JobOutcome, WarmPool

from .credentials import PandaStackCredentials
from .exceptions import SandboxJobFailed
from .execution import JobRequest, execute, run_logger
from .sandbox import PandaStackSandbox, SandboxOverrides
from .tasks import TASK_OPTIONS, RunOptions, build_request


@dataclass(frozen=True)
class WarmParent:
    """A warmed parent sandbox (JSON-safe to pass to tasks)."""

    parent_id: str
    warmup_result: Any = None


@contextmanager
def warm_pool(
    command: str,
    files: Optional[Mapping[str, Any]] = None,
    input: Any = None,
    *,
    sandbox: Optional[PandaStackSandbox] = None,
    credentials: Optional[PandaStackCredentials] = None,
    parent_ttl: int = DEFAULT_PARENT_TTL,
    **overrides: Unpack[SandboxOverrides],
) -> Iterator[WarmParent]:
    """Create a parent sandbox, run the warm-up ``command`` in it once, and yield it for forking.

    ``overrides`` are the job's options for the warm-up, as for :func:`run_in_sandbox`.
    Raises :class:`SandboxJobFailed` if the warm-up fails (the parent is deleted then).
    """
    request = build_request(
        command, files, input, sandbox=sandbox, credentials=credentials, job_name="warm-up", **overrides
    )
    creds = request.credentials_or_default()
    client = creds.get_client()
    log = run_logger()
    pool = WarmPool(client, request.spec, parent_ttl=parent_ttl, redactor=creds.redactor())
    try:
        parent_id = pool.start_parent()
    except Exception as exc:
        outcome: Optional[JobOutcome] = getattr(exc, "outcome", None)
        if outcome is not None:
            raise SandboxJobFailed.from_outcome(outcome) from None
        raise
    try:
        warm = pool.warmup_outcome
        log.info("pandastack: warm parent %s ready (warm-up ran once)", parent_id)
        yield WarmParent(parent_id=parent_id, warmup_result=warm.result if warm else None)
    finally:
        pool.close()
        log.info("pandastack: warm parent %s and its forks deleted", parent_id)


def _fork_runner(parent_id: str) -> Any:
    def run(client: Any, spec: Any, **kwargs: Any) -> JobOutcome:
        return WarmPool.attach(client, parent_id, redactor=kwargs.pop("redactor", None)).run(spec, **kwargs)

    return run


@task(name="run_in_fork", **TASK_OPTIONS)
def run_in_fork(
    parent: WarmParent,
    command: str,
    files: Optional[Mapping[str, Any]] = None,
    input: Any = None,
    **options: Unpack[RunOptions],
) -> Any:
    """Run one job in a fresh fork of ``parent`` (from :func:`warm_pool`) and return its JSON result.

    Takes :func:`~prefect_blocks.run_in_sandbox`'s options, except ``template``: a
    fork is made from its parent's.
    """
    if "template" in options:
        raise TypeError(
            "run_in_fork() got an unexpected keyword argument 'template' (a fork is its parent's)"
        )
    request: JobRequest = build_request(command, files, input, **options)
    return execute(request, runner=_fork_runner(parent.parent_id)).result
