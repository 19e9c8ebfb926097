"""What came of one job: success, or a failure that is either redelivered or dead-lettered."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any


class FailureClass(str, Enum):
    """What the orchestrator should do with a failed job (the queue analogy)."""

    REDELIVER = "redeliver"  # nack: retry in a fresh sandbox
    DEAD_LETTER = "dead_letter"  # to the DLQ: retrying cannot help


class FailureKind(str, Enum):
    """Why a job failed. The :class:`~pandastack_jobs.classify.Classifier` maps each to a class."""

    EXIT_CODE = "exit_code"
    PERMANENT_EXIT_CODE = "permanent_exit_code"
    TIMEOUT = "timeout"
    RESULT_MISSING = "result_missing"
    RESULT_INVALID = "result_invalid"
    RESULT_TOO_LARGE = "result_too_large"
    AUTH = "auth"
    BAD_REQUEST = "bad_request"
    UNKNOWN_TEMPLATE = "unknown_template"
    CAPACITY = "capacity"
    SANDBOX_LOST = "sandbox_lost"
    CONNECTION = "connection"
    SERVER_ERROR = "server_error"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class Timings:
    """Seconds spent in each step of the lifecycle (0.0 for a step that did not run)."""

    create: float = 0.0
    deliver: float = 0.0
    exec: float = 0.0
    collect: float = 0.0
    delete: float = 0.0
    total: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """Seconds per step, rounded to 0.1 ms, for XCom and artifacts."""
        return {k: round(v, 4) for k, v in self.__dict__.items()}


class Verdict:
    """``redeliver`` and ``dead_letter``, read from ``failure_class`` in one place: for the
    outcome, and for an engine's exception that carries only the outcome's summary."""

    @property
    def failure_class(self) -> FailureClass | None:
        raise NotImplementedError  # a field or a property of the class this is mixed into

    @property
    def redeliver(self) -> bool:
        """True when a retry in a fresh sandbox may succeed."""
        return self.failure_class is FailureClass.REDELIVER

    @property
    def dead_letter(self) -> bool:
        """True when retrying cannot help."""
        return self.failure_class is FailureClass.DEAD_LETTER


class SummaryVerdict(Verdict):
    """The outcome's fields read back from its JSON-safe :meth:`JobOutcome.summary`: the base of
    the engines' ``SandboxJobFailed`` (prefect_blocks, pandastack_celery), which carry only the
    summary so that their engines can store and rebuild them."""

    summary: dict[str, Any]

    @staticmethod
    def failure_message(outcome: JobOutcome, why: str = "") -> str:
        """``sandbox job failed [kind, class]: reason`` (``why``, when given, for the reason)."""
        kind = outcome.kind.value if outcome.kind else "unknown"
        klass = outcome.failure_class.value if outcome.failure_class else "unknown"
        return f"sandbox job failed [{kind}, {klass.replace('_', '-')}]: {why or outcome.reason}"

    @property
    def kind(self) -> FailureKind | None:
        value = self.summary.get("kind")
        return FailureKind(value) if value else None

    @property
    def failure_class(self) -> FailureClass | None:
        value = self.summary.get("class")
        return FailureClass(value) if value else None

    @property
    def retry_after(self) -> float | None:
        """The server's capacity ``Retry-After`` in seconds, when the job was refused for capacity."""
        value = self.summary.get("retry_after")
        return float(value) if value is not None else None

    @property
    def exit_code(self) -> int | None:
        value = self.summary.get("exit_code")
        return int(value) if value is not None else None


@dataclass(frozen=True)
class JobOutcome(Verdict):
    """The whole story of one job. ``result`` is parsed JSON only; ``files`` are raw bytes.

    Texts (``reason``, tails) are already redacted. Nothing in here was unpickled
    or evaluated.
    """

    ok: bool
    kind: FailureKind | None = None
    failure_class: FailureClass | None = None
    reason: str = ""
    exit_code: int | None = None
    stdout_tail: str = ""
    stderr_tail: str = ""
    result: Any = None
    has_result: bool = False
    files: Mapping[str, bytes] = field(default_factory=dict)
    sandbox_id: str | None = None
    timings: Timings = field(default_factory=Timings)
    retry_after: float | None = None
    teardown_error: str | None = None
    job_id: str | None = None
    try_number: int | None = None
    standby: bool | None = None
    """With a standby (``run_job(..., standby=...)``): True when the job ran in it, False when it
    was gone and the job ran cold in a fresh sandbox; None without one. (In the standby, the job
    itself still runs cold when its runner was gone: attach falls back in the same sandbox.)"""

    def __post_init__(self) -> None:
        object.__setattr__(self, "files", MappingProxyType(dict(self.files)))

    def summary(self) -> dict[str, Any]:
        """A JSON-safe summary (no file contents) for XCom, artifacts and logs."""
        return {
            "ok": self.ok,
            "kind": self.kind.value if self.kind else None,
            "class": self.failure_class.value if self.failure_class else None,
            "reason": self.reason,
            "exit_code": self.exit_code,
            "sandbox_id": self.sandbox_id,
            "job_id": self.job_id,
            "try_number": self.try_number,
            "retry_after": self.retry_after,
            "timings": self.timings.as_dict(),
            "files": {path: len(data) for path, data in self.files.items()},
            "teardown_error": self.teardown_error,
            "standby": self.standby,
        }
