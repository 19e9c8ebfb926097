"""Turning SDK exceptions and exit codes into failure kinds and readable reasons."""

from __future__ import annotations

import signal

import pandastack
import requests

from .connection import last_refusal
from .exceptions import PandaStackJobsError
from .outcome import FailureKind

# Phrases of the hosted platform's capacity refusals (the SDK raises the last
# one unchanged when its retry budget runs out).
_CAPACITY_PHRASES = (
    "no compute capacity",
    "insufficient host memory",
    "sandbox host unavailable",
    "rate limit",
)
# Default waits when the refusal's Retry-After was not seen (retry budget 0).
_DEFAULT_RETRY_AFTER = {"no compute capacity": 5.0, "sandbox host unavailable": 15.0}
FALLBACK_RETRY_AFTER = 1.0


class StepError(PandaStackJobsError):
    """A lifecycle step failed for a reason the core detected itself (not an SDK error)."""

    def __init__(self, kind: FailureKind, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


def capacity_retry_after(message: str) -> float | None:
    """Seconds to wait before redelivering a job refused for capacity, or None if not capacity."""
    lowered = message.lower()
    if not any(p in lowered for p in _CAPACITY_PHRASES):
        return None
    refusal = last_refusal()
    if refusal is not None and refusal.retry_after_seconds is not None:
        return refusal.retry_after_seconds
    for phrase, seconds in _DEFAULT_RETRY_AFTER.items():
        if phrase in lowered:
            return seconds
    return FALLBACK_RETRY_AFTER


# Exception types whose kind does not depend on the step or the message, checked in this order
# (subclasses before their bases): the first table before, the second after, the step-dependent
# and message-dependent cases in between.
_KindTable = tuple[tuple[type[BaseException], FailureKind], ...]
_KIND_FIRST: _KindTable = (
    (pandastack.CreateCancelled, FailureKind.CANCELLED),
    (pandastack.AuthError, FailureKind.AUTH),
    (pandastack.SandboxTimeout, FailureKind.TIMEOUT),
    (pandastack.ExecInterrupted, FailureKind.SANDBOX_LOST),
)
_KIND_LAST: _KindTable = (
    (pandastack.BadRequestError, FailureKind.BAD_REQUEST),
    (pandastack.ServerError, FailureKind.SERVER_ERROR),
    (pandastack.PandastackError, FailureKind.SERVER_ERROR),
)


def _by_type(exc: BaseException, table: _KindTable) -> FailureKind | None:
    return next((kind for types, kind in table if isinstance(exc, types)), None)


def kind_for_error(exc: BaseException, step: str) -> FailureKind | None:
    """The failure kind of an exception raised during ``step``; None for unknown errors (bugs)."""
    if isinstance(exc, StepError):
        return exc.kind
    kind = _by_type(exc, _KIND_FIRST)
    if kind is not None:
        return kind
    if isinstance(exc, pandastack.APIConnectionError):
        return FailureKind.CONNECTION if step == "create" else FailureKind.SANDBOX_LOST
    if isinstance(exc, requests.RequestException):
        # Raised by the SDK's stream reader when the connection drops mid-exec.
        return FailureKind.SANDBOX_LOST
    message = str(exc).lower()
    if isinstance(exc, (pandastack.ServerError, pandastack.BadRequestError)):
        if step == "create" and capacity_retry_after(message) is not None:
            return FailureKind.CAPACITY
        if step == "create" and "template" in message:
            return FailureKind.UNKNOWN_TEMPLATE
    if isinstance(exc, pandastack.NotFoundError):
        return FailureKind.BAD_REQUEST if step == "create" else FailureKind.SANDBOX_LOST
    return _by_type(exc, _KIND_LAST)


def describe_exit(exit_code: int) -> str:
    """``exit code 137 (SIGKILL: ...)``: the code, and what a signal exit usually means."""
    text = f"exit code {exit_code}"
    if 128 < exit_code < 128 + 65:
        try:
            name = signal.Signals(exit_code - 128).name
        except ValueError:
            return text
        hint = {
            "SIGKILL": "killed: out of memory, or killed by the sandbox",
            "SIGSEGV": "crashed",
            "SIGTERM": "terminated",
            "SIGABRT": "aborted",
        }.get(name)
        text += f" ({name}{': ' + hint if hint else ''})"
    return text


def last_line(text: str, limit: int = 300) -> str:
    """The last non-empty line of ``text``, clipped: the usual one-line cause of a failure."""
    for line in reversed(text.splitlines()):
        if line.strip():
            line = line.strip()
            return line if len(line) <= limit else line[: limit - 1] + "…"
    return ""
