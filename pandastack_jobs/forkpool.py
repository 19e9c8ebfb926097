"""Warm parent + fork per job: pay an expensive warm-up once, run every job in its own fork.

The parent runs only the warm-up and is never handed to a job, so it stays
pristine. Each job runs in a fork (a private copy of the parent's disk) that
gets its own TTL set explicitly, because the server gives cold-fork children
none, and is deleted afterwards like any job sandbox. Closing the pool deletes
the parent and any child a crashed job left behind.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from types import TracebackType

import pandastack
from pandastack import Sandbox

from .exceptions import PandaStackJobsError
from .lifecycle import CreatedCallback, JobHandle, JobRun, OutputCallback, reap_before
from .outcome import JobOutcome
from .reaper import delete_sandbox, sweep_forks
from .redact import Redactor
from .spec import DEFAULT_PARENT_TTL, JobSpec

logger = logging.getLogger(__name__)


class WarmupFailed(PandaStackJobsError, RuntimeError):
    """The warm-up failed in the parent; the parent was deleted. ``outcome`` says why."""

    def __init__(self, outcome: JobOutcome) -> None:
        super().__init__(f"warm-up failed ({outcome.kind.value if outcome.kind else '?'}): {outcome.reason}")
        self.outcome = outcome


class WarmPool:
    """A warmed parent sandbox that jobs fork from.

    In one process::

        with WarmPool(client, warmup=JobSpec(command="python3 warm.py", files=...)) as pool:
            outcomes = [pool.run(spec) for spec in specs]

    Across processes (an orchestrator's setup task, mapped tasks, a teardown
    task): ``parent_id = WarmPool(client, warmup).start_parent()`` in setup,
    ``WarmPool.attach(client, parent_id).run(spec)`` per job, and
    ``WarmPool.attach(client, parent_id).close()`` in teardown.
    """

    def __init__(
        self,
        client: pandastack.Client,
        warmup: JobSpec | None = None,
        *,
        parent_ttl: int = DEFAULT_PARENT_TTL,
        redactor: Redactor | None = None,
        parent_id: str | None = None,
    ) -> None:
        self.client = client
        self.warmup = warmup
        self.parent_ttl = parent_ttl
        self.redactor = redactor
        self.parent_id = parent_id
        self.warmup_outcome: JobOutcome | None = None

    @classmethod
    def attach(
        cls, client: pandastack.Client, parent_id: str, *, redactor: Redactor | None = None
    ) -> WarmPool:
        """A pool handle for a parent started elsewhere (another task, another process)."""
        return cls(client, parent_id=parent_id, redactor=redactor)

    def start_parent(self) -> str:
        """Create the parent, run the warm-up in it once, and return its id.

        Raises :class:`WarmupFailed` (after deleting the parent) if the warm-up fails.
        """
        if self.parent_id is not None:
            return self.parent_id
        if self.warmup is None:
            raise ValueError("warmup: a WarmPool needs a warm-up JobSpec to start a parent")
        spec = self.warmup
        parent_spec = replace(
            spec,
            ttl=max(self.parent_ttl, spec.ttl_seconds),
            metadata={**spec.metadata, "role": "warm-parent"},
        )
        reap_before(self.client, parent_spec)  # a parent a killed earlier attempt left
        # On failure the runner deletes the parent; on success it is kept for forking.
        outcome = JobRun(self.client, parent_spec, redactor=self.redactor, keep_on_success=True).run()
        self.warmup_outcome = outcome
        if not outcome.ok:
            raise WarmupFailed(outcome)
        assert outcome.sandbox_id is not None
        self.parent_id = outcome.sandbox_id
        return self.parent_id

    def fork(self, spec: JobSpec) -> Sandbox:
        """A new child of the parent, with the job's TTL set (children get none otherwise)."""
        if self.parent_id is None:
            raise RuntimeError("the pool has no parent: call start_parent() or use it as a context manager")
        child: Sandbox = self.client.sandboxes.fork(self.parent_id, metadata=spec.sandbox_metadata())
        try:
            child.set_ttl(spec.ttl_seconds)
        except Exception:
            delete_sandbox(self.client, child.id)
            raise
        return child

    def run(
        self,
        spec: JobSpec,
        *,
        on_created: CreatedCallback | None = None,
        on_output: OutputCallback | None = None,
        handle: JobHandle | None = None,
    ) -> JobOutcome:
        """Run ``spec`` in a fresh fork of the parent; the child is deleted afterwards.

        Sandboxes of earlier attempts of ``spec.key`` are reaped first, as by
        :func:`~pandastack_jobs.run_job`.
        """
        reap_before(self.client, spec)
        run = JobRun(
            self.client,
            spec,
            on_created=on_created,
            on_output=on_output,
            handle=handle,
            redactor=self.redactor,
        )
        return run.run(acquire=lambda: self.fork(spec))

    def close(self) -> None:
        """Delete leftover children and the parent (idempotent)."""
        if self.parent_id is None:
            return
        try:
            leftovers = sweep_forks(self.client, self.parent_id)
            if leftovers:
                logger.info("deleted %d leftover fork(s) of %s", len(leftovers), self.parent_id)
        except pandastack.PandastackError as exc:
            logger.warning("could not sweep forks of %s: %s", self.parent_id, exc)
        delete_sandbox(self.client, self.parent_id)

    def __enter__(self) -> WarmPool:
        self.start_parent()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
