"""Retries as redelivery: retry only what a fresh sandbox can fix, after a jittered delay.

Prefect asks ``retry_condition_fn(task, task_run, state)`` whether a failed run
may retry. :func:`retry_on_redeliver` answers yes only for a
:class:`~prefect_blocks.exceptions.SandboxJobFailed` that the core classified as
redeliverable (non-zero exit, timeout, lost sandbox, network, capacity);
dead-lettered jobs (permanent exit codes, a missing or invalid result, auth,
bad requests) and anything that is not a sandbox failure fail at once.

The delay is ours, not Prefect's, unless the task sets one: Prefect computes a
task's retry delays once per task, so every mapped task would wake together.
The package's tasks leave ``retry_delay_seconds`` at :data:`REDELIVERY_DELAY`
(0 to Prefect); then, when the condition says yes, it records for that task run
an exponential delay with full jitter that is never shorter than the server's
capacity ``Retry-After``, and the next attempt waits that long before it reaps
and creates. A task given any other ``retry_delay_seconds`` (``0`` included,
e.g. ``run_in_sandbox.with_options(retry_delay_seconds=0)``) gets exactly
Prefect's delay; only a capacity ``Retry-After`` still holds it back.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional
from uuid import UUID

from .exceptions import SandboxJobFailed
from .settings import get_settings

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_pending: dict[UUID, float] = {}
_uniform = random.uniform


class RedeliveryDelay(float):
    """A ``retry_delay_seconds`` of 0 for Prefect that asks for the package's jittered delay."""

    def __repr__(self) -> str:
        return "REDELIVERY_DELAY"


REDELIVERY_DELAY = RedeliveryDelay(0)
"""The default ``retry_delay_seconds`` of the package's tasks: the jittered redelivery delay.
Pass it to your own ``@task(retry_condition_fn=retry_on_redeliver, ...)`` to get the same."""


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter: attempt n waits in [base*2^(n-1)*(1-jitter), base*2^(n-1)]."""

    base: float = 2.0
    cap: float = 300.0
    jitter: float = 0.5

    def delay(self, retry_number: int, retry_after: Optional[float] = None) -> float:
        """The wait before retry ``retry_number`` (1 = first retry), at least ``retry_after``."""
        ceiling = min(self.cap, self.base * (2 ** max(0, retry_number - 1)))
        delay = _uniform(ceiling * (1 - self.jitter), ceiling) if ceiling > 0 else 0.0
        if retry_after is not None:
            # Capacity: never sooner than the server asked, plus a little spread.
            delay = max(delay, retry_after + _uniform(0, max(1.0, retry_after * 0.2)))
        return delay


def default_backoff() -> Backoff:
    """The backoff from the integration settings (``PREFECT_INTEGRATIONS_PANDASTACK_RETRY_*``)."""
    settings = get_settings()
    return Backoff(base=settings.retry_base_seconds, cap=settings.retry_max_seconds)


def failure_of(state: Any) -> Optional[BaseException]:
    """The exception a Failed state carries (Prefect passes it as ``state.data``), if any."""
    data = getattr(state, "data", None)
    if isinstance(data, BaseException):
        return data
    try:
        value = state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001 - a state we cannot read is not ours to retry
        return None
    return value if isinstance(value, BaseException) else None


class RetryOnRedeliver:
    """A ``retry_condition_fn`` that retries only redeliverable sandbox failures.

    ``backoff`` defaults to :func:`default_backoff`, read when a failure happens.
    A plain object (not a closure) so tasks that use it can be pickled by
    Prefect's runners.
    """

    __name__ = "retry_on_redeliver"

    def __init__(self, backoff: Optional[Backoff] = None) -> None:
        self.backoff = backoff

    def __repr__(self) -> str:
        return f"RetryOnRedeliver(backoff={self.backoff!r})"

    def backoff_for(self, task: Any) -> Backoff:
        """Ours for a task that left its delay to us; none (only capacity waits) if it set one."""
        if isinstance(getattr(task, "retry_delay_seconds", REDELIVERY_DELAY), RedeliveryDelay):
            return self.backoff or default_backoff()
        return Backoff(base=0.0)

    def __call__(self, task: Any, task_run: Any, state: Any) -> bool:
        exc = failure_of(state)
        if not isinstance(exc, SandboxJobFailed):
            return False
        if not exc.redeliver:
            logger.info("dead-lettered, not retrying: %s", exc.message)
            return False
        retry_number = max(1, int(getattr(task_run, "run_count", 1) or 1))
        delay = self.backoff_for(task).delay(retry_number, exc.retry_after)
        with _lock:
            _pending[task_run.id] = delay
        return True


def make_retry_condition(backoff: Optional[Backoff] = None) -> Callable[[Any, Any, Any], bool]:
    """A ``retry_condition_fn`` that retries only redeliverable sandbox failures, with ``backoff``.

    A plain function: Prefect 3.6 to 3.8 call a retry condition only when ``inspect.isfunction``
    says it is one (an object with ``__call__`` silently turned retries off there).
    Prefect pickles tasks with cloudpickle, which carries a closure by value.
    """
    condition = RetryOnRedeliver(backoff)

    def retry_on_redeliver(task: Any, task_run: Any, state: Any) -> bool:
        return condition(task, task_run, state)

    retry_on_redeliver.condition = condition  # type: ignore[attr-defined]
    return retry_on_redeliver


_DEFAULT_CONDITION = RetryOnRedeliver()


def retry_on_redeliver(task: Any, task_run: Any, state: Any) -> bool:
    """The default ``retry_condition_fn`` of :func:`~prefect_blocks.run_in_sandbox` and
    ``@sandbox_task``: a module-level function (picklable by name, ``inspect.isfunction`` on
    every supported Prefect)."""
    return _DEFAULT_CONDITION(task, task_run, state)


def take_redelivery_delay(task_run_id: Optional[UUID]) -> float:
    """The delay recorded for this task run's next attempt (0 if none), forgetting it."""
    if task_run_id is None:
        return 0.0
    with _lock:
        return _pending.pop(task_run_id, 0.0)


def wait_for_redelivery(task_run_id: Optional[UUID], log: Any = None) -> float:
    """Sleep for the recorded redelivery delay of this task run; return how long."""
    delay = take_redelivery_delay(task_run_id)
    if delay > 0:
        if log is not None:
            log.info("pandastack: redelivering in a fresh sandbox after %.1fs", delay)
        time.sleep(delay)
    return delay


async def await_redelivery(task_run_id: Optional[UUID], log: Any = None) -> float:
    """Async form of :func:`wait_for_redelivery`."""
    import anyio

    delay = take_redelivery_delay(task_run_id)
    if delay > 0:
        if log is not None:
            log.info("pandastack: redelivering in a fresh sandbox after %.1fs", delay)
        await anyio.sleep(delay)
    return delay
