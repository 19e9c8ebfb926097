"""The redelivery table as an Airflow 3.3 ``retry_policy`` (AIP-105).

The operator raises :class:`~airflow_provider.exceptions.PandaStackJobRedeliver`
for failures a fresh sandbox may fix and
:class:`~airflow_provider.exceptions.PandaStackJobDeadLetter` (an
``AirflowFailException``, never retried) for the rest. The policy adds what an
exception class alone cannot say: a capacity refusal's ``Retry-After`` becomes
the minimum delay before the retry. It is the default ``retry_policy`` of every
PandaStack operator; pass it to other tasks (or wrap it) as you like::

    from airflow_provider.retries import pandastack_retry_policy

    PandaStackSandboxOperator(..., retries=3, retry_policy=pandastack_retry_policy)
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from .compat import RetryDecision, RetryPolicy
from .exceptions import PandaStackJobDeadLetter, PandaStackJobRedeliver

if TYPE_CHECKING:
    from airflow.sdk.definitions.context import Context


def _task_delay(context: Context | None) -> timedelta | None:
    task = context.get("task") if context else None
    delay = getattr(task, "retry_delay", None)
    if isinstance(delay, timedelta):
        return delay
    if isinstance(delay, (int, float)):
        return timedelta(seconds=delay)
    return None


class PandaStackRetryPolicy(RetryPolicy):
    """Redeliver → retry (waiting at least the capacity ``Retry-After``); dead-letter → fail.

    Any other exception falls through to the task's ordinary retry logic.
    """

    def evaluate(
        self,
        exception: BaseException,
        try_number: int,
        max_tries: int,
        context: Context | None = None,
    ) -> RetryDecision:
        if isinstance(exception, PandaStackJobDeadLetter):
            return RetryDecision.fail(reason=f"dead-letter ({exception.kind}): {exception.reason}"[:500])
        if isinstance(exception, PandaStackJobRedeliver):
            reason = f"redeliver ({exception.kind}) in a fresh sandbox"
            if exception.retry_after is None:
                return RetryDecision.retry(reason=reason)
            minimum = timedelta(seconds=exception.retry_after)
            configured = _task_delay(context)
            if configured is not None and configured >= minimum:
                return RetryDecision.retry(reason=reason)
            return RetryDecision.retry(
                delay=minimum,
                reason=f"{reason}, after the server's Retry-After of {exception.retry_after:g}s",
            )
        return RetryDecision.default()

    def serialize(self) -> dict[str, Any]:
        return {"__type": "PandaStackRetryPolicy"}

    @classmethod
    def deserialize(cls, data: dict[str, Any]) -> PandaStackRetryPolicy:
        return cls()


pandastack_retry_policy = PandaStackRetryPolicy()
"""The ready-made policy instance (stateless; share it)."""
