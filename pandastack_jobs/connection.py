"""Building SDK clients, and remembering the server's ``Retry-After`` on capacity refusals.

The SDK retries capacity refusals itself but raises the last one without its
headers. A client built here records every refusal it saw (per thread), so a
job that ran out of create budget can still tell the orchestrator how long to
wait before redelivery. It also records the HTTP status (and ``Retry-After``) of
the last error answer (per thread): the SDK's exceptions carry only a type and the
server's text, and a failure is classified by status, never by words in that text
(``failures.py``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pandastack
import requests
from pandastack import CreateRetryEvent

DEFAULT_REQUEST_TIMEOUT = 30.0

_local = threading.local()


def _record_refusal(event: CreateRetryEvent) -> None:
    _local.last_refusal = event


def reset_refusals() -> None:
    """Forget the refusals recorded on this thread (called before each create)."""
    _local.last_refusal = None
    _local.last_answer = None


@dataclass(frozen=True)
class ErrorAnswer:
    """The HTTP status of an error answer and its ``Retry-After`` (seconds), if it sent one."""

    status: int
    retry_after: float | None = None


def record_answer(answer: ErrorAnswer | None) -> None:
    """Remember ``answer`` as this thread's last error answer (None: the last request had none)."""
    _local.last_answer = answer


def last_answer() -> ErrorAnswer | None:
    """The status of the error answer the SDK's last exception on this thread came from; None when
    that request got no answer (a connection error) or the client was not built here."""
    return getattr(_local, "last_answer", None)


def _retry_after(value: str | None) -> float | None:
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date: not worth parsing for a hint
    return seconds if seconds is not None and 0 <= seconds < 86400 else None


def _recording(session: requests.Session) -> None:
    """Make ``session`` record each request's error answer (or its absence) on the calling thread:
    the SDK raises right after the answer it maps, so the last one recorded is that exception's."""
    send = session.request

    def request(*args: Any, **kwargs: Any) -> requests.Response:
        record_answer(None)
        response = send(*args, **kwargs)
        if response.status_code >= 400:
            wait = _retry_after(response.headers.get("Retry-After"))
            record_answer(ErrorAnswer(response.status_code, wait))
        return response

    session.request = request  # type: ignore[method-assign]


def last_refusal() -> CreateRetryEvent | None:
    """The last capacity refusal the SDK retried on this thread, if any."""
    return getattr(_local, "last_refusal", None)


@dataclass(frozen=True)
class ConnectionConfig:
    """Where PandaStack is and how to talk to it. The key is never shown in ``repr``.

    ``api_url``/``api_key`` left as None fall back to the SDK's environment
    (``PANDASTACK_API``, ``PANDASTACK_API_KEY``, ``~/.config/pandastack``).
    """

    api_url: str | None = None
    api_key: str | None = field(default=None, repr=False)
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    max_create_retry_seconds: float | None = None

    def client(self) -> pandastack.Client:
        """A new SDK client that records capacity refusals for the job runner."""
        client = pandastack.Client(
            api_url=self.api_url,
            api_key=self.api_key,
            timeout=self.request_timeout,
            max_create_retry_seconds=self.max_create_retry_seconds,
            on_create_retry=_record_refusal,
        )
        if isinstance(getattr(client, "session", None), requests.Session):
            _recording(client.session)
        return client
