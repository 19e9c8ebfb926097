"""The one base of the local server's exceptions.

Every exception class of ``pandastack_local`` derives from :class:`PandaStackLocalError` (and
keeps the builtin it always was), except the guest's (``guest/``: standard library only, it runs
inside the sandbox and imports nothing of the host's).
"""

from __future__ import annotations


class PandaStackLocalError(Exception):
    """Base of every exception the local server's host side defines."""


class ApiError(PandaStackLocalError):
    """An error with the HTTP status and message the wire API promises (raised by the manager and by
    what it builds on, limits.py, so it lives below both; manager re-exports it)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}
