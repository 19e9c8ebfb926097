"""One bounded wait for every suite and the e2e topology: poll until a condition holds, or fail
saying what was awaited and what was last seen."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from pandastack_local.exceptions import PandaStackLocalError

T = TypeVar("T")


class WaitTimeout(PandaStackLocalError, AssertionError):
    """A bounded wait ran out; the message says what was awaited and the last value seen."""


def wait_for(
    what: str,
    probe: Callable[[], T],
    *,
    timeout: float,
    interval: float = 0.5,
    check: Callable[[T], bool] = bool,
    on_timeout: Callable[[], str] | None = None,
    abort: Callable[[], str | None] | None = None,
) -> T:
    """Poll ``probe`` until ``check(value)`` holds; raise :class:`WaitTimeout` after ``timeout`` s.

    Exceptions from ``probe`` count as "not yet" (the last one is reported).
    ``abort`` returning a message ends the wait at once (e.g. the awaited process died).
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    last_exc: BaseException | None = None
    while True:
        try:
            last = probe()
            last_exc = None
            if check(last):
                return last
        except Exception as exc:
            last_exc = exc
        fatal = abort() if abort else None
        if fatal:
            raise WaitTimeout(f"gave up waiting for {what}: {fatal}")
        if time.monotonic() >= deadline:
            extra = on_timeout() if on_timeout else ""
            detail = f"last error: {last_exc!r}" if last_exc else f"last value: {last!r}"
            raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {what}; {detail} {extra}".strip())
        time.sleep(interval)
