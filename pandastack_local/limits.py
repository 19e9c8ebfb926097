"""Every cap the server puts on what a client or a sandbox can make it hold or do.

One place, so the docs (docs/local-server.md, "Limits") and the tests name the same
numbers. Each one bounds the server's memory or time per request; none of them is
reached by ordinary jobs.
"""

from __future__ import annotations

from pandastack_local.guest.agent import MAX_READ_BYTES
from pandastack_local.templates.registry import Template

KiB = 1024
MiB = 1024 * KiB

# Request bodies: a file upload (PUT fs), and every JSON body. Past them: 413.
MAX_FILE_BODY_BYTES = 32 * MiB
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
    "FILE_READ_CAP_BYTES",
    "LOG_COMMAND_CHARS",
    "LOG_OUTPUT_CHARS",
    "MAX_CODE_CONTEXTS",
    "MAX_COMMAND_BYTES",
    "MAX_CONCURRENT_EXECS",
    "MAX_EXEC_OUTPUT_BYTES",
    "MAX_FILE_BODY_BYTES",
    "MAX_JSON_BODY_BYTES",
    "MAX_REPL_OUTPUT_BYTES",
    "MAX_REPL_PNG_BYTES",
    "MAX_REPL_REPLY_BYTES",
    "MAX_REPL_RESULTS",
    "MAX_REPL_TEXT_RESULT_BYTES",
    "REPL_DEFAULT_TIMEOUT_MS",
    "REPL_KILL_GRACE_SECONDS",
    "REPL_START_SECONDS",
    "exec_slots",
    "fork_copy_cap",
]


def exec_slots(template: Template) -> int:
    """How many execs a sandbox of ``template`` runs at once without its agent running out of
    descriptors (a 128-file template gets 14, the 1024-file default 32)."""
    return max(1, min(MAX_CONCURRENT_EXECS, (template.nofile - AGENT_RESERVED_FDS) // AGENT_FDS_PER_EXEC))


def fork_copy_cap(template: Template) -> int:
    """The file data a fork copies at most: the template's disk (a child could hold no more)."""
    return template.disk_mb * MiB
