"""Reading a result that came back on the job exec's stdout (:class:`~.guest.ResultTrailer`).

The reader splits the stream as it arrives: the job's own output goes on to the
log at once (holding back only a tail that could be the start of the mark), and
whatever follows the mark is kept, at most ``limit + 1`` bytes and the closing
line, never more. It is a fast path only: :meth:`TrailerReader.result` answers
None for anything but a whole, clean trailer of a regular file within the limit
(no trailer, a truncated or overlong one, bytes that were not UTF-8, output after
the closing line), and the caller then stats and reads the file as before, which
names every failure as it always did.
"""

from __future__ import annotations

from collections.abc import Callable

from .guest import ResultTrailer

# Room past the result for the closing line: "MARK e<dd's exit code>\n".
_CLOSING_SLACK = 16


def held_back(text: str, mark: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``mark``."""
    i = text.find(mark[0], max(0, len(text) - len(mark) + 1))
    while i != -1:
        if mark.startswith(text[i:]):
            return len(text) - i
        i = text.find(mark[0], i + 1)
    return 0


class TrailerReader:
    """Splits one exec's stdout into the job's output (passed to ``emit``) and the trailer."""

    def __init__(self, trailer: ResultTrailer, emit: Callable[[str], None]) -> None:
        self.limit = trailer.limit
        self._opening = f"{trailer.mark} f\n"
        self._closing = f"{trailer.mark} e0\n"
        self._emit = emit
        self._pending = ""
        self._body: list[str] | None = None
        self._size = 0
        self._cap = trailer.limit + 1 + len(self._closing) + _CLOSING_SLACK
        self.overflow = False

    def add(self, chunk: str) -> None:
        """Take the next stdout chunk."""
        if self._body is not None:
            self._keep(chunk)
            return
        text = self._pending + chunk
        at = text.find(self._opening)
        if at >= 0:
            self._pending = ""
            self._send(text[:at])
            self._body = []
            self._keep(text[at + len(self._opening) :])
            return
        hold = held_back(text, self._opening)
        self._pending = text[len(text) - hold :] if hold else ""
        self._send(text[: len(text) - hold])

    def finish(self) -> None:
        """The stream ended: what was held back was the job's output after all, and so is what
        came after the closing line (a background process of the job still writing)."""
        pending, self._pending = self._pending, ""
        self._send(pending)
        if self._body is not None:
            body = "".join(self._body)
            at = body.find(self._closing)
            if at >= 0:
                self._send(body[at + len(self._closing) :])

    def result(self) -> bytes | None:
        """The result's bytes from a whole, clean trailer; None: read the file instead."""
        if self._body is None or self.overflow:
            return None
        body = "".join(self._body)
        if not body.endswith(self._closing):
            return None
        content = body[: -len(self._closing)]
        if "\ufffd" in content:  # the server replaced bytes that were not UTF-8: let the read decide
            return None
        try:
            data = content.encode("utf-8")
        except UnicodeEncodeError:
            return None
        return data if len(data) <= self.limit else None

    def _keep(self, chunk: str) -> None:
        room = self._cap - self._size
        if len(chunk) > room:
            self.overflow = True
            chunk = chunk[: max(room, 0)]
        if chunk and self._body is not None:
            self._body.append(chunk)
            self._size += len(chunk)

    def _send(self, text: str) -> None:
        if text:
            self._emit(text)
