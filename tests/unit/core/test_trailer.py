"""The result trailer on a job's stdout: the job's output passes whole, the result is kept bounded,
and anything the reader cannot vouch for sends the core back to reading the file."""

from __future__ import annotations

import pytest

from pandastack_jobs.guest import ResultTrailer
from pandastack_jobs.trailer import TrailerReader, held_back


def _read(chunks: list[str], limit: int = 100) -> tuple[str, bytes | None]:
    trailer = ResultTrailer("/work/result.json", limit, nonce="n0nce")
    out: list[str] = []
    reader = TrailerReader(trailer, out.append)
    for chunk in chunks:
        reader.add(chunk)
    reader.finish()
    return "".join(out), reader.result()


MARK = ResultTrailer("/r", 1, nonce="n0nce").mark


def test_output_and_result_split_at_the_mark_in_any_chunking() -> None:
    stream = f'log line\nno newline{MARK} f\n{{"a": 1}}{MARK} e0\n'
    for size in (1, 2, 3, 7, len(stream)):
        chunks = [stream[i : i + size] for i in range(0, len(stream), size)]
        assert _read(chunks) == ("log line\nno newline", b'{"a": 1}')


def test_no_trailer_leaves_the_output_whole_and_no_result() -> None:
    assert _read(["abc\x1e", "pandastack-res"]) == ("abc\x1epandastack-res", None)


@pytest.mark.parametrize(
    "tail",
    [
        f"{MARK} f\n123",  # cut before the closing line
        f"{MARK} f\n123{MARK} e1\n",  # dd failed
        f"{MARK} f\n\ufffd{MARK} e0\n",  # bytes that were not UTF-8, replaced by the server
        f"{MARK} f\n{'1' * 101}{MARK} e0\n",  # past the limit
        f"{MARK} f\n{'1' * 5000}",  # far past it: kept bounded
    ],
)
def test_a_trailer_that_cannot_be_vouched_for_gives_no_result(tail: str) -> None:
    out, result = _read(["job output\n", tail])
    assert out == "job output\n" and result is None


def test_the_reader_keeps_at_most_the_limit_and_the_closing_line() -> None:
    trailer = ResultTrailer("/r", 10, nonce="n0nce")
    reader = TrailerReader(trailer, lambda _c: None)
    reader.add(f"{MARK} f\n")
    for _ in range(1000):
        reader.add("x" * 1000)
    assert reader.overflow and sum(len(c) for c in reader._body or []) < 100


def test_the_mark_is_never_whole_in_the_shell_line() -> None:
    trailer = ResultTrailer("/work/result.json", 10)
    assert trailer.mark not in trailer.shell() and trailer.nonce in trailer.shell()


def test_held_back_is_only_a_possible_start_of_the_mark() -> None:
    assert held_back("abc", MARK) == 0
    assert held_back("abc\x1e", MARK) == 1
    assert held_back("abc\x1epandastack-", MARK) == len("\x1epandastack-")
    assert held_back("abc\x1exyz", MARK) == 0


def test_output_after_the_closing_line_still_reaches_the_log() -> None:
    out, result = _read(["job\n", f"{MARK} f\n1{MARK} e0\n", "late line\n"])
    assert out == "job\nlate line\n" and result is None
