"""Every cap the server puts on what a client or a sandbox can make it hold or do.

One place, so the docs (docs/local-server.md, "Limits") and the tests name the same
numbers. Each one bounds the server's memory or time per request; none of them is
reached by ordinary jobs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from pandastack_local.exceptions import ApiError
from pandastack_local.guest.agent import MAX_READ_BYTES
from pandastack_local.templates.registry import Template

KiB = 1024
MiB = 1024 * KiB

# Request bodies: a file upload (PUT fs), and every JSON body. Past them: 413.
MAX_FILE_BODY_BYTES = 32 * MiB
# An idle TTL and an exec timeout have ceilings: a TTL of 10**30 would be no TTL at all (only
# persistent: true may mean that), and a timeout past a float's range cannot be waited on.
MAX_TTL_SECONDS = 7 * 86400
MAX_EXEC_TIMEOUT_SECONDS = 86400
MAX_JSON_BODY_BYTES = 1 * MiB
# A command is one argv string to /bin/sh: the kernel refuses one of 128 KiB or more (E2BIG), and
# the agent puts a short prefix before it, so a command must stay under 127 KiB.
MAX_COMMAND_BYTES = 127 * KiB
# Reading a file (GET fs, and so the core's result and collected files): 4xx past it.
FILE_READ_CAP_BYTES = MAX_READ_BYTES
# A non-stream exec keeps this much of each of stdout and stderr; /exec/stream has no cap.
MAX_EXEC_OUTPUT_BYTES = 1 * MiB
# What the sandbox log keeps of one command and of one exec's output.
LOG_COMMAND_CHARS = 1024
LOG_OUTPUT_CHARS = 4096
# Concurrent execs per sandbox: each holds about this many descriptors in the agent, whose
# RLIMIT_NOFILE is the template's nofile. Past the limit: 429 with Retry-After.
MAX_CONCURRENT_EXECS = 32
AGENT_FDS_PER_EXEC = 8
AGENT_RESERVED_FDS = 16
EXEC_RETRY_AFTER = "1"
# exec/stream: what one stream can make the server hold for a client that does not read it (its
# reader buffers at most ~2x STREAM_READ_AHEAD_BYTES plus one 256 KiB socket read from the agent; the
# response's write buffer at most its 64 KiB high-water mark plus one SSE event, a 64 KiB chunk that
# JSON escapes can grow 6x): each stream reserves STREAM_HOLD_BYTES of a server-wide budget
# (--stream-buffer-mb, config.DEFAULT_STREAM_BUFFER_MB) while it runs. Past it: 503 with Retry-After.
STREAM_READ_AHEAD_BYTES = 64 * KiB
STREAM_HOLD_BYTES = 1 * MiB
STREAM_RETRY_AFTER = "1"
# Connections (api/connections.py): at most MAX_CONNECTIONS at once and MAX_CONNECTIONS_PER_CLIENT
# from one client address (both lowered to fit the descriptor limit: connection_caps); past them a
# JSON 503 / 429 with Retry-After. A request's headers within HEADER_TIMEOUT_SECONDS (408) and
# MAX_HEADER_BYTES (431); an idle kept-alive connection closed after KEEP_ALIVE_SECONDS; one whose
# client reads nothing of its answer for WRITE_STALL_SECONDS dropped.
MAX_CONNECTIONS = 1024
MAX_CONNECTIONS_PER_CLIENT = 256
HEADER_TIMEOUT_SECONDS = 10.0
KEEP_ALIVE_SECONDS = 5
MAX_HEADER_BYTES = 16 * KiB
WRITE_STALL_SECONDS = 60.0
REFUSE_LINGER_SECONDS = 1.0
MAX_LINGERING_CONNECTIONS = 64
FD_RESERVE = 64
# Code contexts (api/routes/code_contexts.py, guest/repl_kernel.py). Per run: the first MAX_REPL_OUTPUT_BYTES
# of stdout and of stderr, at most MAX_REPL_RESULTS results (a figure's PNG at most
# MAX_REPL_PNG_BYTES, a repr or HTML at most MAX_REPL_TEXT_RESULT_BYTES), and the whole reply the
# server reads from the sandbox at most MAX_REPL_REPLY_BYTES (JSON escapes can grow text 6x).
MAX_CODE_CONTEXTS = 8  # per sandbox; past it, 429
MAX_REPL_OUTPUT_BYTES = 1 * MiB
MAX_REPL_RESULTS = 8
MAX_REPL_PNG_BYTES = 1 * MiB
MAX_REPL_TEXT_RESULT_BYTES = 64 * KiB
MAX_REPL_REPLY_BYTES = 32 * MiB
# A run's timeout when the request gives none (the real server's 30 s), and how long past it the
# session may take to stop before its process is killed (its state is then lost).
REPL_DEFAULT_TIMEOUT_MS = 30_000
REPL_KILL_GRACE_SECONDS = 5.0
REPL_START_SECONDS = 30.0

__all__ = [
    "FD_RESERVE",
    "FILE_READ_CAP_BYTES",
    "HEADER_TIMEOUT_SECONDS",
    "KEEP_ALIVE_SECONDS",
    "LOG_COMMAND_CHARS",
    "LOG_OUTPUT_CHARS",
    "MAX_CODE_CONTEXTS",
    "MAX_COMMAND_BYTES",
    "MAX_CONCURRENT_EXECS",
    "MAX_CONNECTIONS",
    "MAX_CONNECTIONS_PER_CLIENT",
    "MAX_EXEC_OUTPUT_BYTES",
    "MAX_FILE_BODY_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_JSON_BODY_BYTES",
    "MAX_LINGERING_CONNECTIONS",
    "MAX_REPL_OUTPUT_BYTES",
    "MAX_REPL_PNG_BYTES",
    "MAX_REPL_REPLY_BYTES",
    "MAX_REPL_RESULTS",
    "MAX_REPL_TEXT_RESULT_BYTES",
    "REFUSE_LINGER_SECONDS",
    "REPL_DEFAULT_TIMEOUT_MS",
    "REPL_KILL_GRACE_SECONDS",
    "REPL_START_SECONDS",
    "STREAM_HOLD_BYTES",
    "STREAM_READ_AHEAD_BYTES",
    "STREAM_RETRY_AFTER",
    "WRITE_STALL_SECONDS",
    "Hold",
    "StreamBudget",
    "connection_caps",
    "exec_slots",
    "fork_copy_cap",
]


def connection_caps(nofile: int, max_total: int, max_per_client: int, sandboxes: int) -> tuple[int, int]:
    """(total, per client address) that fit ``nofile`` descriptors: a connection can hold its socket
    and one agent connection, a live sandbox its lifeline, a refused one lingers; FD_RESERVE for the
    rest. The per-address cap stays at most half the total, so one address cannot take it all."""
    room = max((nofile - FD_RESERVE - sandboxes - MAX_LINGERING_CONNECTIONS) // 2, 8)
    total = min(max_total, room)
    return total, max(1, min(max_per_client, total // 2))


def exec_slots(template: Template) -> int:
    """How many execs a sandbox of ``template`` runs at once without its agent running out of
    descriptors (a 128-file template gets 14, the 1024-file default 32)."""
    return max(1, min(MAX_CONCURRENT_EXECS, (template.nofile - AGENT_RESERVED_FDS) // AGENT_FDS_PER_EXEC))


def fork_copy_cap(template: Template) -> int:
    """The file data a fork copies at most: the template's disk (a child could hold no more)."""
    return template.disk_mb * MiB


# A request body that sends nothing for this long is refused (408, api/routes/deps.read_body): a
# stalled upload would hold its connection and what it sent of the transfer budget.
BODY_IDLE_SECONDS = 30.0


class StreamBudget:
    """The server-wide budget of memory held for slow peers (``--stream-buffer-mb``): a reader of
    exec/stream or of a file (GET fs) holds STREAM_HOLD_BYTES of it from start to end (both stream,
    with back-pressure from the client's socket); an upload (PUT fs) holds its body as it arrives,
    kept whole until all of it has (so a broken upload never touches the file; one that stalls is
    a 408 after ``BODY_IDLE_SECONDS``). A
    transfer that would pass the budget is refused: 503 with Retry-After, or 413 when it is larger
    than the whole budget (it could never fit)."""

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.held = 0

    @contextlib.contextmanager
    def hold(self, what: str = "exec/stream", nbytes: int = STREAM_HOLD_BYTES) -> Iterator[Hold]:
        """Reserve ``nbytes`` for ``what`` (its name in the refusal) until the block ends; the
        ``Hold`` it yields can grow."""
        hold = Hold(self, what)
        try:
            hold.grow(nbytes)
            yield hold
        finally:
            self.held -= hold.nbytes

    def refusal(self, what: str, nbytes: int, wanted: int) -> ApiError:
        budget = (
            f"the server's {self.total_bytes // MiB} MiB budget for slow readers and uploads "
            "(--stream-buffer-mb)"
        )
        if wanted > self.total_bytes:
            return ApiError(
                413,
                f"{what} refused: it needs {wanted} bytes, more than the whole of {budget}: send less, "
                "or raise the flag",
            )
        return ApiError(
            503,
            f"{what} refused: {self.held} bytes of {budget} are held by transfers in progress and "
            f"this one needs {nbytes} more; retry when one ends",
            {"Retry-After": STREAM_RETRY_AFTER},
        )


class Hold:
    """One transfer's reservation of a ``StreamBudget``."""

    def __init__(self, budget: StreamBudget, what: str) -> None:
        self.budget = budget
        self.what = what
        self.nbytes = 0

    def grow(self, nbytes: int) -> None:
        """Reserve ``nbytes`` more, or raise the refusal (the reservation so far stays held)."""
        if self.budget.held + nbytes > self.budget.total_bytes:
            raise self.budget.refusal(self.what, nbytes, self.nbytes + nbytes)
        self.budget.held += nbytes
        self.nbytes += nbytes
