"""Building SDK clients, and remembering the server's ``Retry-After`` on capacity refusals.

The SDK retries capacity refusals itself but raises the last one without its
headers. A client built here records every refusal it saw (per thread), so a
job that ran out of create budget can still tell the orchestrator how long to
wait before redelivery.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pandastack
from pandastack import CreateRetryEvent

DEFAULT_REQUEST_TIMEOUT = 30.0

_local = threading.local()


def _record_refusal(event: CreateRetryEvent) -> None:
    _local.last_refusal = event


def reset_refusals() -> None:
    """Forget the refusals recorded on this thread (called before each create)."""
    _local.last_refusal = None


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
        return pandastack.Client(
            api_url=self.api_url,
            api_key=self.api_key,
            timeout=self.request_timeout,
            max_create_retry_seconds=self.max_create_retry_seconds,
            on_create_retry=_record_refusal,
        )
