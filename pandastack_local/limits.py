"""Every cap the server puts on what a client or a sandbox can make it hold or do.

One place, so the docs (docs/local-server.md, "Limits") and the tests name the same
numbers. Each one bounds the server's memory or time per request; none of them is
reached by ordinary jobs.
"""

from __future__ import annotations

from .agent import MAX_READ_BYTES
from .templates import Template

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

__all__ = [
    "FILE_READ_CAP_BYTES",
    "LOG_COMMAND_CHARS",
    "LOG_OUTPUT_CHARS",
    "MAX_COMMAND_BYTES",
    "MAX_CONCURRENT_EXECS",
    "MAX_EXEC_OUTPUT_BYTES",
    "MAX_FILE_BODY_BYTES",
    "MAX_JSON_BODY_BYTES",
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
