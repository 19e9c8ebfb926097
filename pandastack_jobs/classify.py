"""Failure classification: redeliver (retry in a fresh sandbox) or dead-letter (give up).

The defaults are ``_DEAD`` below. A failure that retrying cannot fix (a
permanent exit code, a job that exits 0 but writes no valid result, bad
credentials, a bad request, an unknown template) is dead-lettered; everything
transient (a crash, a timeout, a lost sandbox, the network, capacity) is
redelivered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .outcome import FailureClass, FailureKind

_DEAD = frozenset(
    {
        FailureKind.PERMANENT_EXIT_CODE,
        FailureKind.RESULT_MISSING,
        FailureKind.RESULT_INVALID,
        FailureKind.RESULT_TOO_LARGE,
        FailureKind.AUTH,
        FailureKind.BAD_REQUEST,
        FailureKind.UNKNOWN_TEMPLATE,
        FailureKind.CANCELLED,
    }
)

CustomRule = Callable[[FailureKind, "int | None"], "FailureClass | None"]


@dataclass(frozen=True)
class Classifier:
    """Maps a failure to a class.

    ``permanent_exit_codes``: job exit codes that mean "this input will never
    work" (dead-letter at once). ``retry_on_timeout``: False dead-letters jobs that
    ran out of time. ``custom``: called first with ``(kind, exit_code)``; return a
    :class:`FailureClass` to decide, or None to fall back to the defaults.
    """

    permanent_exit_codes: frozenset[int] = field(default_factory=frozenset)
    retry_on_timeout: bool = True
    custom: CustomRule | None = None

    def __post_init__(self) -> None:
        codes: Iterable[int] = self.permanent_exit_codes
        frozen = frozenset(codes)
        for code in frozen:
            if not isinstance(code, int) or isinstance(code, bool) or not 0 < code < 256:
                from .exceptions import JobSpecError

                raise JobSpecError(
                    "permanent_exit_codes", f"{code!r} is not an exit code", "use ints from 1 to 255"
                )
        object.__setattr__(self, "permanent_exit_codes", frozen)

    def kind_for_exit(self, exit_code: int) -> FailureKind:
        """The kind of a non-zero exit: permanent or ordinary."""
        if exit_code in self.permanent_exit_codes:
            return FailureKind.PERMANENT_EXIT_CODE
        return FailureKind.EXIT_CODE

    def classify(self, kind: FailureKind, exit_code: int | None = None) -> FailureClass:
        """The class of a failure of ``kind``."""
        if self.custom is not None:
            decided = self.custom(kind, exit_code)
            if decided is not None:
                return FailureClass(decided)
        if kind is FailureKind.TIMEOUT and not self.retry_on_timeout:
            return FailureClass.DEAD_LETTER
        if kind in _DEAD:
            return FailureClass.DEAD_LETTER
        return FailureClass.REDELIVER
