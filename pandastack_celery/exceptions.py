"""The exception a failed sandbox task raises: JSON-safe, so Celery's result backend stores it.

It carries the job's summary (kind, class, reason, exit code, Retry-After), never the key and
never file contents. Its ``args`` are ``(message, summary)``: Celery's JSON result serializer
stores them and rebuilds the same exception for ``AsyncResult.get()``; nothing is pickled.
"""

from __future__ import annotations

from typing import Any, Optional

from pandastack_jobs import FailureClass, FailureKind, JobOutcome
from pandastack_jobs.outcome import Verdict


class PandaStackCeleryError(Exception):
    """Base of every exception ``pandastack_celery`` defines."""


class SandboxTaskConfigError(PandaStackCeleryError, ValueError):
    """A sandbox task is declared or called in a way that cannot work; the message names the
    setting and the fix."""


class SandboxJobFailed(PandaStackCeleryError, Verdict):
    """A sandbox job failed. ``redeliver`` says whether a retry in a fresh sandbox may help."""

    def __init__(self, message: str, summary: Optional[dict[str, Any]] = None) -> None:
        super().__init__(message, dict(summary or {}))
        self.message = message
        self.summary: dict[str, Any] = dict(summary or {})

    def __str__(self) -> str:
        return self.message

    @classmethod
    def from_outcome(cls, outcome: JobOutcome, why: str = "") -> SandboxJobFailed:
        kind = outcome.kind.value if outcome.kind else "unknown"
        klass = outcome.failure_class.value if outcome.failure_class else "unknown"
        message = f"sandbox job failed [{kind}, {klass.replace('_', '-')}]: {why or outcome.reason}"
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
