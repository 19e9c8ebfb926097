"""The shell lines that run inside the guest.

The open-source server does not enforce an exec's ``timeout_seconds``, so the
job's clock is enforced inside the guest with coreutils ``timeout``: TERM at the
deadline, KILL a few seconds later. The server is asked for a longer timeout as
a second rail, and the HTTP request waits longer than both.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping

from .spec import INPUT_PATH, RESULT_PATH, WORKDIR

KILL_GRACE_SECONDS = 5
# The server's own clock fires only if the guest's failed to.
SERVER_TIMEOUT_MARGIN_SECONDS = 10
TIMEOUT_EXIT_CODE = 124  # coreutils timeout: the command ran out of time
DETACHED_DIR = f"{WORKDIR}/.pandastack"
DETACHED_EXIT = f"{DETACHED_DIR}/exit"
DETACHED_STDOUT = f"{DETACHED_DIR}/stdout"
DETACHED_STDERR = f"{DETACHED_DIR}/stderr"


def _seconds(value: float) -> str:
    text = f"{value:.3f}".rstrip("0").rstrip(".")
    return text or "0"


def job_env(result_path: str | None, extra: Mapping[str, str], workdir: str = WORKDIR) -> dict[str, str]:
    """Variables every job sees: its work directory, where its input is and where its result goes.

    ``workdir`` differs from :data:`WORKDIR` only for a queue chunk's mates, each in its own.
    """
    default_result = RESULT_PATH if workdir == WORKDIR else f"{workdir}/result.json"
    env = {"JOB_WORKDIR": workdir, "JOB_INPUT": input_path(workdir)}
    env["JOB_RESULT"] = result_path or default_result
    env.update(extra)
    return env


def input_path(workdir: str = WORKDIR) -> str:
    """Where a job's JSON input is written: ``input.json`` in its work directory."""
    return INPUT_PATH if workdir == WORKDIR else f"{workdir}/input.json"


def timed_command(command: str, timeout: float, env: Mapping[str, str]) -> str:
    """``command`` under the guest-side hard timeout, in the work directory."""
    assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return (
        f"env {assigns} timeout -s TERM -k {KILL_GRACE_SECONDS} {_seconds(timeout)} "
        f"sh -c {shlex.quote(command)}"
    )


def foreground_command(command: str, timeout: float, env: Mapping[str, str], workdir: str = WORKDIR) -> str:
    """The exec line of a job the orchestrator waits for.

    ``mkdir`` runs only when the work directory is missing: spawning it on every job
    cost ~5 ms per job in the guest (benchmarks/RESULTS.md, section 1b).
    """
    wd = shlex.quote(workdir)
    prepare = f"{{ [ -d {wd} ] || mkdir -p {wd}; }} && cd {wd}"
    return f"{prepare} && exec {timed_command(command, timeout, env)}"


def detached_command(command: str, timeout: float, env: Mapping[str, str]) -> str:
    """The exec line of a job that runs on after the exec returns (deferrable mode).

    Output goes to files and the exit code is written atomically to
    :data:`DETACHED_EXIT` when the job ends, so a poller can tell "running" from
    "done" with one stat.
    """
    inner = (
        f"{timed_command(command, timeout, env)}; "
        f"echo $? > {DETACHED_EXIT}.tmp && mv {DETACHED_EXIT}.tmp {DETACHED_EXIT}"
    )
    return (
        f"mkdir -p {DETACHED_DIR} && cd {WORKDIR} && "
        f"nohup sh -c {shlex.quote(inner)} > {DETACHED_STDOUT} 2> {DETACHED_STDERR} < /dev/null &"
    )


def server_timeout(timeout: float) -> int:
    """What the server is asked for: longer than the guest's clock plus its KILL grace."""
    return math.ceil(timeout) + KILL_GRACE_SECONDS + SERVER_TIMEOUT_MARGIN_SECONDS


def timed_out(exit_code: int, elapsed: float, timeout: float) -> bool:
    """True when the guest's clock killed the job: a timeout or signal exit, at the deadline.

    Both are needed: a job may exit 124 on its own, early, and a job killed for
    memory exits 137 before its deadline.
    """
    return exit_code in (TIMEOUT_EXIT_CODE, 137, 143) and elapsed >= timeout
