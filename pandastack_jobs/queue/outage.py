"""The PandaStack API as the queue consumer sees it: which one it talks to, whether it answers, and
what of a failed job is the platform's doing rather than the message's.

An outage of the platform (the API unreachable, answering 5xx, or out of capacity) is never
charged to a message (docs/queues.md, "When PandaStack is down"): the consumer gives back what it
pulled without counting the delivery, pauses pulling, probes the API with a bounded, jittered
backoff, and resumes when it answers. A capacity refusal of one message while others' creates
go through is that message's, not an outage: it counts (the consumer's ``_room_for_others``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
from collections import OrderedDict
from urllib.parse import urlsplit, urlunsplit

import pandastack
from pandastack.client import DEFAULT_API_URL

from ..connection import ConnectionConfig
from ..exceptions import PandaStackJobsError
from ..outcome import FailureKind, JobOutcome

EXIT_API_UNREACHABLE = 4
"""``consume``'s exit code when the PandaStack API cannot be reached at the start."""
EXIT_API_KEY_REJECTED = 5
"""``consume``'s exit code when the PandaStack API refuses the key (or there is none)."""


class ApiCheckError(PandaStackJobsError):
    """The PandaStack API cannot be used; the message is one line, without the key."""

    exit_code = EXIT_API_UNREACHABLE


class ApiUnreachable(ApiCheckError):
    """No answer from the API (connection, DNS, TLS, timeout) or only server errors (5xx)."""


class ApiKeyRejected(ApiCheckError):
    """The API answered and refused the key, or no key is configured."""

    exit_code = EXIT_API_KEY_REJECTED


def api_url(connection: ConnectionConfig) -> str:
    """The base URL the SDK will use for ``connection`` (its own resolution order), without any
    user or password written into it."""
    client = connection.client()
    try:
        return _safe_url(str(client.api_url))
    finally:
        _close(client)


def _safe_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def describe_api(connection: ConnectionConfig) -> str:
    """Which API, and why that one: never the key."""
    url = api_url(connection)
    if connection.api_url is not None:
        return url
    if os.environ.get("PANDASTACK_API"):
        return f"{url} (PANDASTACK_API)"
    if url.rstrip("/") == DEFAULT_API_URL.rstrip("/"):
        return f"{url} (the hosted API: PANDASTACK_API is not set; set it for a local or own server)"
    return f"{url} (~/.config/pandastack/config.json)"


PROBE_TIMEOUT = 10.0
"""Seconds a probe waits for the API's answer."""


def probe(connection: ConnectionConfig) -> None:
    """Ask the API who the key belongs to (``GET /v1/me``): return if it answers and takes the
    key, raise :class:`ApiUnreachable` or :class:`ApiKeyRejected` (one line, no key) if not. Any
    other answer (a 404 from a server without the route, a 429) counts as answering."""
    if type(connection) is ConnectionConfig and connection.request_timeout > PROBE_TIMEOUT:
        connection = dataclasses.replace(connection, request_timeout=PROBE_TIMEOUT)
    client = connection.client()
    url = _safe_url(str(client.api_url))
    key = str(client.api_key or "")
    if not key:
        _close(client)
        raise ApiKeyRejected("no PandaStack API key: set PANDASTACK_API_KEY")
    try:
        client.me()
    except pandastack.AuthError as exc:
        raise ApiKeyRejected(_clean(f"the PandaStack API at {url} refused the key: {exc}", key)) from None
    except pandastack.APIConnectionError as exc:
        why = f"cannot reach the PandaStack API at {url}: {_cause(exc)}"
        raise ApiUnreachable(_clean(why, key)) from None
    except pandastack.ServerError as exc:
        why = f"the PandaStack API at {url} answers with server errors: {exc}"
        raise ApiUnreachable(_clean(why, key)) from None
    except pandastack.PandastackError:
        return
    except OSError as exc:
        raise ApiUnreachable(_clean(f"cannot reach the PandaStack API at {url}: {exc}", key)) from None
    finally:
        _close(client)


def _cause(exc: BaseException) -> str:
    """The root of a connection error, short: ``[Errno 111] Connection refused``."""
    text = str(exc.__cause__ or exc)
    tail = text.rsplit(": ", 1)[-1].strip(" '\")(")
    return tail or type(exc).__name__


def _clean(text: str, key: str) -> str:
    one = " ".join(text.split())
    if key:
        one = one.replace(key, "***")
    return one if len(one) <= 300 else one[:299] + "…"


def _close(client: object) -> None:
    close = getattr(client, "close", None)
    if callable(close):
        with contextlib.suppress(Exception):  # a test double without a session
            close()


def platform_failure(outcome: JobOutcome) -> bool:
    """True when the job never ran because of the platform (the API unreachable or answering 5xx at
    the create, or out of capacity): nothing of the message's doing, so the delivery is not charged."""
    if outcome.ok or outcome.kind is None:
        return False
    if outcome.kind in (FailureKind.CONNECTION, FailureKind.CAPACITY):
        return True
    return outcome.kind is FailureKind.SERVER_ERROR and outcome.sandbox_id is None


def maybe_platform(outcome: JobOutcome) -> bool:
    """True for a failure mid-job that a dying server also explains (the sandbox lost, a 5xx): the
    delivery is charged (once), and the consumer checks whether the API is still there."""
    return not outcome.ok and outcome.kind in (FailureKind.SANDBOX_LOST, FailureKind.SERVER_ERROR)


class Backoff:
    """Waits between probes: doubling from ``first`` up to ``cap`` seconds, each drawn uniformly
    from its upper half, so consumers that lost the API together do not come back together."""

    def __init__(self, first: float = 1.0, cap: float = 15.0) -> None:
        self.first, self.cap = first, cap
        self._next = first

    def next(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self.cap)
        return random.uniform(delay / 2, delay)  # noqa: S311 - jitter, not a secret

    def reset(self) -> None:
        self._next = self.first


class Uncharged:
    """Per message (the broker's id), the deliveries the platform spoiled, which the consumer does
    not count against ``max_deliveries``. Bounded: the oldest entries go first."""

    def __init__(self, limit: int = 100_000) -> None:
        self.limit = limit
        self._counts: OrderedDict[str, int] = OrderedDict()

    def add(self, message_id: str) -> None:
        self._counts[message_id] = self._counts.get(message_id, 0) + 1
        self._counts.move_to_end(message_id)
        while len(self._counts) > self.limit:
            self._counts.popitem(last=False)

    def get(self, message_id: str) -> int:
        return self._counts.get(message_id, 0)

    def forget(self, message_id: str) -> None:
        self._counts.pop(message_id, None)

    def charged(self, message_id: str, count: int) -> int:
        """The deliveries of a message that count: the broker's ``count`` minus the spoiled ones."""
        return max(1, count - self.get(message_id))
