"""Turning a job's streamed output into log lines, the same way for every engine.

Output arrives in chunks that split lines anywhere. :class:`LineSplitter`
reassembles whole lines per stream and hands each to the engine's logger. A
line longer than ``max_chars`` is cut into pieces of ``max_chars``, each
emitted and all but the last marked with :data:`CONTINUED`: nothing is dropped
silently, however a job prints. An optional ``max_lines`` caps the lines per
stream, and says so once when it starts dropping.
"""

from __future__ import annotations

from collections.abc import Callable

MAX_LINE_CHARS = 8192
CONTINUED = "…"
"""Ends each piece of a line that was cut because it was longer than ``max_chars``."""

LineCallback = Callable[[str, str], None]
"""Called with ``(stream, line)``; stream is "stdout" or "stderr"."""


class LineSplitter:
    """An output callback (``(stream, chunk)``) that emits whole lines to ``emit``."""

    def __init__(
        self, emit: LineCallback, *, max_chars: int = MAX_LINE_CHARS, max_lines: int | None = None
    ) -> None:
        if max_chars < 1:
            raise ValueError(f"max_chars: {max_chars!r} is not a positive number of characters")
        self._emit = emit
        self.max_chars = max_chars
        self.max_lines = max_lines
        self._partial: dict[str, str] = {}
        self._count: dict[str, int] = {}

    def __call__(self, stream: str, chunk: str) -> None:
        text = self._partial.get(stream, "") + chunk
        *lines, rest = text.split("\n")
        for line in lines:
            self._line(stream, line.rstrip("\r"))
        while len(rest) > self.max_chars:  # an overlong line in the making: emit its full pieces now
            self._send(stream, rest[: self.max_chars] + CONTINUED)
            rest = rest[self.max_chars :]
        self._partial[stream] = rest

    def flush(self) -> None:
        """Emit what is left of each stream's last line (the job ended without a newline)."""
        partial, self._partial = self._partial, {}
        for stream, rest in partial.items():
            if rest:
                self._line(stream, rest.rstrip("\r"))

    def _line(self, stream: str, line: str) -> None:
        while len(line) > self.max_chars:
            self._send(stream, line[: self.max_chars] + CONTINUED)
            line = line[self.max_chars :]
        self._send(stream, line)

    def _send(self, stream: str, line: str) -> None:
        n = self._count.get(stream, 0) + 1
        self._count[stream] = n
        if self.max_lines is None or n <= self.max_lines:
            self._emit(stream, line)
        elif n == self.max_lines + 1:
            self._emit(stream, f"... more {stream} not logged (its tail is kept in the outcome)")
