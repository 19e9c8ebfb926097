"""The exception a failed sandbox task raises: JSON-safe, so Celery's result backend stores it.

It carries the job's summary (kind, class, reason, exit code, Retry-After), never the key and
never file contents. Its ``args`` are ``(message, summary)``: Celery's JSON result serializer
stores them and rebuilds the same exception for ``AsyncResult.get()``; nothing is pickled.
"""

from __future__ import annotations

from typing import Any, Optional

from pandastack_jobs import JobOutcome
from pandastack_jobs.outcome import SummaryVerdict


class PandaStackCeleryError(Exception):
    """Base of every exception ``pandastack_celery`` defines."""


class SandboxTaskConfigError(PandaStackCeleryError, ValueError):
    """A sandbox task is declared or called in a way that cannot work; the message names the
    setting and the fix."""


class SandboxJobFailed(PandaStackCeleryError, SummaryVerdict):
    """A sandbox job failed. ``redeliver`` says whether a retry in a fresh sandbox may help."""

    def __init__(self, message: str, summary: Optional[dict[str, Any]] = None) -> None:
        super().__init__(message, dict(summary or {}))
        self.message = message
        self.summary: dict[str, Any] = dict(summary or {})

    def __str__(self) -> str:
        return self.message

    @classmethod
    def from_outcome(cls, outcome: JobOutcome, why: str = "") -> SandboxJobFailed:
        return cls(cls.failure_message(outcome, why), outcome.summary())

    @classmethod
    def over_max_deliveries(cls, deliveries: int, cap: int) -> SandboxJobFailed:
        """A try delivered more than ``cap`` times without settling (its worker died each time):
        failed at once, never run again."""
        reason = (
            f"delivered {deliveries} times without a result, over max_deliveries={cap}: the worker "
            "running it died each time (a SIGKILL, the OOM killer); not run again"
        )
        summary = {"ok": False, "kind": None, "class": "dead_letter", "reason": reason}
        return cls(f"sandbox task failed [max_deliveries, dead-letter]: {reason}", summary)
