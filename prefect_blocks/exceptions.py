"""The collection's exceptions: one base, and the one a failed sandbox job raises in a task.

Every exception class of ``prefect_blocks`` derives from :class:`PandaStackPrefectError` (and
keeps the builtin it always was). :class:`SandboxJobFailed` carries the job's JSON-safe summary
(kind, class, reason, exit code, Retry-After), never the key and never file contents, so it can
be logged, stored in a Failed state and pickled by Prefect safely.
"""

from __future__ import annotations

from typing import Any, Optional

from pandastack_jobs import FailureClass, FailureKind, JobOutcome
from pandastack_jobs.outcome import Verdict


class PandaStackPrefectError(Exception):
    """Base of every exception the collection defines."""


class SandboxJobFailed(PandaStackPrefectError, Verdict):
    """A sandbox job failed. ``redeliver`` says whether a retry in a fresh sandbox may help."""

    def __init__(self, message: str, summary: Optional[dict[str, Any]] = None) -> None:
        super().__init__(message)
        self.message = message
        self.summary: dict[str, Any] = dict(summary or {})

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.summary))

    @classmethod
    def from_outcome(cls, outcome: JobOutcome) -> SandboxJobFailed:
        kind = outcome.kind.value if outcome.kind else "unknown"
        klass = outcome.failure_class.value if outcome.failure_class else "unknown"
        message = f"sandbox job failed [{kind}, {klass.replace('_', '-')}]: {outcome.reason}"
        return cls(message, outcome.summary())

    @property
    def kind(self) -> Optional[FailureKind]:
        value = self.summary.get("kind")
        return FailureKind(value) if value else None

    @property
    def failure_class(self) -> Optional[FailureClass]:
        value = self.summary.get("class")
        return FailureClass(value) if value else None

    @property
    def retry_after(self) -> Optional[float]:
        """The server's capacity ``Retry-After`` in seconds, when the job was refused for capacity."""
        value = self.summary.get("retry_after")
        return float(value) if value is not None else None

    @property
    def exit_code(self) -> Optional[int]:
        value = self.summary.get("exit_code")
        return int(value) if value is not None else None
