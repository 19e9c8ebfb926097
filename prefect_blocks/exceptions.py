"""The collection's exceptions: one base, and the one a failed sandbox job raises in a task.

Every exception class of ``prefect_blocks`` derives from :class:`PandaStackPrefectError` (and
keeps the builtin it always was). :class:`SandboxJobFailed` carries the job's JSON-safe summary
(kind, class, reason, exit code, Retry-After), never the key and never file contents, so it can
be logged, stored in a Failed state and pickled by Prefect safely.
"""

from __future__ import annotations

from typing import Any, Optional

from pandastack_jobs import JobOutcome
from pandastack_jobs.outcome import SummaryVerdict


class PandaStackPrefectError(Exception):
    """Base of every exception the collection defines."""


class SandboxJobFailed(PandaStackPrefectError, SummaryVerdict):
    """A sandbox job failed. ``redeliver`` says whether a retry in a fresh sandbox may help."""

    def __init__(self, message: str, summary: Optional[dict[str, Any]] = None) -> None:
        super().__init__(message)
        self.message = message
        self.summary: dict[str, Any] = dict(summary or {})

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.summary))

    @classmethod
    def from_outcome(cls, outcome: JobOutcome) -> SandboxJobFailed:
        return cls(cls.failure_message(outcome), outcome.summary())
