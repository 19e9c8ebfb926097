"""The provider's exceptions: one base, and how a job's outcome becomes an Airflow failure
(redeliver → retryable, dead-letter → fail now).

Every exception class of ``airflow_provider`` derives from :class:`PandaStackAirflowError` (and
keeps the class it always was: ``AirflowException``, ``ValueError``...).

Both carry the core's JSON-safe outcome summary (already redacted), so a
callback or a retry policy can read the failure kind and the capacity
``retry_after`` without parsing messages.
"""

from __future__ import annotations

from typing import Any

from pandastack_jobs import JobOutcome

from .compat import AirflowException, AirflowFailException


def _message(outcome: JobOutcome) -> str:
    kind = outcome.kind.value if outcome.kind else "unknown"
    text = f"PandaStack job failed [{kind}]: {outcome.reason}"
    if outcome.sandbox_id:
        text += f" (sandbox {outcome.sandbox_id})"
    return text


class PandaStackAirflowError(Exception):
    """Base of every exception the provider defines."""


class PandaStackJobError(PandaStackAirflowError, AirflowException):
    """Base of the provider's job failures. ``summary`` is :meth:`JobOutcome.summary`."""

    def __init__(self, outcome: JobOutcome) -> None:
        super().__init__(_message(outcome))
        self.summary: dict[str, Any] = outcome.summary()
        self.kind: str | None = outcome.kind.value if outcome.kind else None
        self.reason = outcome.reason
        self.retry_after: float | None = outcome.retry_after


class PandaStackJobRedeliver(PandaStackJobError):
    """A failure a fresh sandbox may fix (crash, timeout, lost sandbox, network, capacity).

    An ordinary :class:`AirflowException`: the task goes ``up_for_retry`` while
    retries remain. ``retry_after`` (capacity refusals) is the minimum delay the
    provider's retry policy asks for.
    """


class PandaStackJobDeadLetter(PandaStackJobError, AirflowFailException):
    """A failure retrying cannot fix (permanent exit code, missing/invalid result, auth,
    bad request, unknown template, cancelled). Fails the task at once, retries left or not."""


def exception_for(outcome: JobOutcome) -> PandaStackJobError:
    """The exception to raise for a failed outcome."""
    if outcome.redeliver:
        return PandaStackJobRedeliver(outcome)
    return PandaStackJobDeadLetter(outcome)
