"""Turning SDK exceptions and exit codes into failure kinds and readable reasons."""

from __future__ import annotations

import signal

import pandastack
import requests

from .connection import ErrorAnswer, last_answer, last_refusal
from .exceptions import PandaStackJobsError
from .outcome import FailureKind

# The answers the SDK's create-retry contract treats as capacity refusals (a 503 with
# Retry-After, any 507, a 429), with the wait to use when the answer carried no Retry-After.
_CAPACITY_STATUS_WAIT = {429: 1.0, 503: 5.0, 507: 5.0}
FALLBACK_RETRY_AFTER = 1.0
# Only for an error whose HTTP status is unknown (a client not built by ConnectionConfig, which
# records statuses, or a test double's raised exception): the hosted platform's capacity phrases.
_CAPACITY_PHRASES = {
    "no compute capacity": 5.0,
    "insufficient host memory": 5.0,
    "sandbox host unavailable": 15.0,
    "rate limit": FALLBACK_RETRY_AFTER,
}


class StepError(PandaStackJobsError):
    """A lifecycle step failed for a reason the core detected itself (not an SDK error)."""

    def __init__(self, kind: FailureKind, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


def _capacity_answer(answer: ErrorAnswer) -> bool:
    if answer.status == 503:
        return answer.retry_after is not None  # a load balancer's bare 503 is not a refusal
    return answer.status in _CAPACITY_STATUS_WAIT


def capacity_retry_after(exc: BaseException) -> float | None:
    """Seconds to wait before redelivering a create refused for capacity, or None if ``exc`` is not
    a capacity refusal. Decided by the HTTP status the SDK got (or the refusal it retried), never
    by the server's words, unless the status is unknown."""
    if not isinstance(exc, (pandastack.ServerError, pandastack.BadRequestError)):
        return None
    refusal = last_refusal()
    answer = last_answer()
    if refusal is not None and (answer is None or _capacity_answer(answer)):
        # The SDK retried this refusal as capacity itself and gave up.
        if refusal.retry_after_seconds is not None:
            return refusal.retry_after_seconds
        return _CAPACITY_STATUS_WAIT.get(refusal.status_code, FALLBACK_RETRY_AFTER)
    if answer is not None:
        if not _capacity_answer(answer):
            return None
        if answer.retry_after is not None:
            return answer.retry_after
        return _CAPACITY_STATUS_WAIT[answer.status]
    # No status known: the one place a server's words decide (see _CAPACITY_PHRASES).
    lowered = str(exc).lower()
    return next((wait for phrase, wait in _CAPACITY_PHRASES.items() if phrase in lowered), None)


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
    """The failure kind of an exception raised during ``step``; None for unknown errors (bugs).

    By the exception's type and the HTTP status of the answer it came from; never by the words of
    the server's message (except capacity when the status is unknown: ``capacity_retry_after``)."""
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
    if step == "create" and capacity_retry_after(exc) is not None:
        return FailureKind.CAPACITY
    # An unknown template is a create's 5xx on the wire (no status of its own): the lifecycle asks
    # the templates API whether the template exists (lifecycle.py, _template_missing).
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
