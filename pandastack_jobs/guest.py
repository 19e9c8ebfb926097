"""The shell lines that run inside the guest.

The open-source server does not enforce an exec's ``timeout_seconds``, so the
job's clock is enforced inside the guest with coreutils ``timeout``: TERM at the
deadline, KILL a few seconds later. The server is asked for a longer timeout as
a second rail, and the HTTP request waits longer than both.
"""

from __future__ import annotations

import math
import secrets
import shlex
from collections.abc import Mapping

from .spec import INPUT_PATH, RESULT_PATH, WORKDIR

KILL_GRACE_SECONDS = 5
# The server's own clock fires only if the guest's failed to.
SERVER_TIMEOUT_MARGIN_SECONDS = 10
TIMEOUT_EXIT_CODE = 124  # coreutils timeout: the command ran out of time
# Starts the marker lines around a result carried on stdout (ResultTrailer); a nonce follows.
RESULT_MARK = "\x1epandastack-result:"
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


def env_assignments(env: Mapping[str, str]) -> str:
    """``env`` as the shell's own prefix assignments (``K='v' ...``), quoted; names are checked by
    :class:`~.spec.JobSpec`. One process start fewer than ``env K=v ...``."""
    return "".join(f"{k}={shlex.quote(v)} " for k, v in env.items())


def timed_command(command: str, timeout: float, env: Mapping[str, str]) -> str:
    """``command`` under the guest-side hard timeout, in the work directory; its exit code in ``$rc``.

    The variables are the shell's own prefix assignments (names are checked by
    :class:`~.spec.JobSpec`), not ``env``: one process start fewer per job.

    ``timeout`` makes its own process group (its pid) and at the deadline sends TERM to
    its child and that group; but the ``sh -c`` wrapper dies at the TERM, so ``timeout``
    sees its child exit, returns 124 at once and never sends the KILL after the grace. A
    process of the job deaf to TERM would outlive its clock in a sandbox that outlives the
    job (a chunk's next mate, a detached job until it is polled). So ``timeout`` runs in
    the background (the exec's stdin is ``/dev/null`` already, as a background job's is),
    the shell waits for it, and after a timeout (124, or 137 once the KILL was sent) it
    polls the group for up to the grace and KILLs what is left: nothing is waited for
    when nothing survived the TERM.
    """
    assigns = env_assignments(env)
    polls = KILL_GRACE_SECONDS * 10
    return (
        f"{assigns}timeout -s TERM -k {KILL_GRACE_SECONDS} {_seconds(timeout)} "
        f"sh -c {shlex.quote(command)} & pg=$!; wait $pg; rc=$?; "
        f"if [ $rc -eq {TIMEOUT_EXIT_CODE} ] || [ $rc -eq 137 ]; then n=0; "
        f"while kill -0 -$pg 2>/dev/null; do "
        f"if [ $n -ge {polls} ]; then kill -KILL -$pg 2>/dev/null; break; fi; "
        "n=$((n+1)); sleep 0.1; done; fi"
    )


def foreground_command(command: str, timeout: float, env: Mapping[str, str], workdir: str = WORKDIR) -> str:
    """The exec line of a job the orchestrator waits for.

    ``mkdir`` runs only when the work directory is missing: spawning it on every job
    cost ~5 ms per job in the guest (benchmarks/RESULTS.md, section 1b).
    """
    wd = shlex.quote(workdir)
    prepare = f"{{ [ -d {wd} ] || mkdir -p {wd}; }} && cd {wd}"
    return f"{prepare} && {{ {timed_command(command, timeout, env)}; exit $rc; }}"


def job_script(
    command: str,
    timeout: float,
    env: Mapping[str, str],
    writes: Mapping[str, str],
    result: ResultTrailer | None,
    workdir: str = WORKDIR,
) -> str:
    """The one exec of a fresh sandbox's job: write its small files, run it, send its result back.

    ``writes`` (absolute path -> text) are written by the shell's ``printf`` builtin
    (no process, no round trip); the job runs under :func:`timed_command`; on exit 0,
    a regular result file's first ``result.limit + 1`` bytes follow the job's stdout
    between two marker lines (:class:`ResultTrailer`), read by ``dd`` with
    ``O_NONBLOCK`` so a FIFO swapped in cannot hang it. The exit code is the job's.
    """
    wd = shlex.quote(workdir)
    steps = [f"{{ [ -d {wd} ] || mkdir -p {wd}; }}", f"cd {wd}"]
    made = {workdir}
    for path, text in writes.items():
        parent = path.rsplit("/", 1)[0] or "/"
        if parent not in made:
            steps.append(f"{{ [ -d {shlex.quote(parent)} ] || mkdir -p {shlex.quote(parent)}; }}")
            made.add(parent)
        steps.append(f"printf %s {shlex.quote(text)} > {shlex.quote(path)}")
    line = f"{' && '.join(steps)} && {{ {timed_command(command, timeout, env)}; }} || rc=$?"
    if result is not None:
        line += f"; if [ $rc -eq 0 ] && [ -f {shlex.quote(result.path)} ]; then {result.shell()}; fi"
    return f"{line}; exit $rc"


class ResultTrailer:
    """The result file carried on the job exec's own stdout, after the job's output.

    Framed as ``MARK f\n<bytes>MARK e<dd's exit>\n`` where ``MARK`` is
    :data:`RESULT_MARK` and a random nonce. The shell prints the mark from two
    separate arguments, so the mark never appears whole in the command line (a job
    that prints ``ps`` output cannot end its own output by accident). A job can still
    forge it on purpose: that can only spoil its own result, which it writes anyway;
    the exit code comes from the server's ``exit`` event, never from the trailer.
    The reader (:class:`~.trailer.TrailerReader`) keeps at most ``limit + 1`` bytes.
    """

    def __init__(self, path: str, limit: int, nonce: str | None = None) -> None:
        self.path = path
        self.limit = limit
        self.nonce = nonce or secrets.token_hex(16)

    @property
    def mark(self) -> str:
        return f"{RESULT_MARK}{self.nonce}"

    def shell(self) -> str:
        fmt = RESULT_MARK.replace("\x1e", "\\036") + "%s"
        path = shlex.quote(self.path)
        return (
            f"printf '{fmt} f\\n' {self.nonce}; "
            f"dd if={path} bs=65536 count={self.limit + 1} iflag=count_bytes,nonblock status=none "
            f"2>/dev/null; printf '{fmt} e%s\\n' {self.nonce} $?"
        )


def detached_command(command: str, timeout: float, env: Mapping[str, str]) -> str:
    """The exec line of a job that runs on after the exec returns (deferrable mode).

    Output goes to files and the exit code is written atomically to
    :data:`DETACHED_EXIT` when the job ends, so a poller can tell "running" from
    "done" with one stat.
    """
    inner = (
        f"{timed_command(command, timeout, env)}; "
        f"echo $rc > {DETACHED_EXIT}.tmp && mv {DETACHED_EXIT}.tmp {DETACHED_EXIT}"
    )
    return background_command(inner, directory=DETACHED_DIR, stdout=DETACHED_STDOUT, stderr=DETACHED_STDERR)


def background_command(inner: str, *, directory: str, stdout: str, stderr: str, env_prefix: str = "") -> str:
    """``inner`` started in the background so the exec returns at once: detached from the exec's
    pipes (output to files, stdin from ``/dev/null``), in the work directory, ``directory`` made
    first. Used for detached jobs and for a standby's warm runner. ``env_prefix``: the shell's
    ``NAME=value `` assignments for it."""
    err = "2>&1" if stderr == stdout else f"2> {stderr}"
    return (
        f"mkdir -p {directory} && cd {WORKDIR} && "
        f"{env_prefix}nohup sh -c {shlex.quote(inner)} > {stdout} {err} < /dev/null &"
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
