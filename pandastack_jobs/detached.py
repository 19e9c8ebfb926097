"""Detached jobs, for deferrable operators and async pollers.

The job is launched in the background inside the sandbox and the exec returns
at once; the orchestrator frees its worker slot and polls for the exit marker
(one ``stat``). The sandbox keeps running between polls because every exec of
a sandbox shares its processes. Finishing collects the result and deletes the
sandbox exactly like a foreground job.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import pandastack
from pandastack import Sandbox

from . import guest
from .exceptions import PandaStackJobsError
from .failures import StepError
from .lifecycle import (
    CreatedCallback,
    JobHandle,
    JobRun,
    OutputCallback,
    StandbySandbox,
    _is_regular,
    reap_before,
    standby_steps,
)
from .outcome import FailureKind, JobOutcome
from .redact import Redactor
from .spec import JobSpec

# A poller gives up this long after the guest clock should have fired.
DEADLINE_MARGIN_SECONDS = guest.KILL_GRACE_SECONDS + 30


@dataclass(frozen=True)
class DetachedJob:
    """A job running in the background in ``sandbox_id`` since ``started_at`` (epoch seconds)."""

    sandbox_id: str
    started_at: float
    timeout: float

    @property
    def deadline(self) -> float:
        """Epoch seconds after which the job is considered lost (its guest clock should have fired)."""
        return self.started_at + self.timeout + DEADLINE_MARGIN_SECONDS

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (a trigger's serialised kwargs)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DetachedJob:
        """The inverse of :meth:`to_dict` (a trigger rebuilt in the triggerer process)."""
        return cls(
            sandbox_id=str(data["sandbox_id"]),
            started_at=float(data["started_at"]),
            timeout=float(data["timeout"]),
        )


class SandboxGone(PandaStackJobsError, RuntimeError):
    """The detached job's sandbox no longer exists (deleted, reaped, or the server restarted)."""


def start_detached(
    client: pandastack.Client,
    spec: JobSpec,
    *,
    on_created: CreatedCallback | None = None,
    handle: JobHandle | None = None,
    redactor: Redactor | None = None,
    reap: bool = True,
    standby: StandbySandbox | None = None,
    standby_command: str | None = None,
) -> DetachedJob | JobOutcome:
    """Create, deliver and launch ``spec`` in the background.

    Returns a :class:`DetachedJob` to poll, or the failure :class:`JobOutcome` if
    the job could not be started (its sandbox is already deleted then).
    ``handle.cancel()`` deletes the sandbox, while starting or once started.
    ``standby``/``standby_command``: as for :func:`~.lifecycle.run_job` (``spec`` is the cold spec).
    """
    if reap:
        reap_before(client, spec)
    started: list[float] = []

    def launch(sb: Sandbox) -> tuple[int, float]:
        env = guest.job_env(spec.result_path, spec.env)
        started.append(time.time())
        result = sb.exec(guest.detached_command(run.command, spec.timeout, env), timeout_seconds=30)
        if result.exit_code != 0:
            return result.exit_code, 0.0
        return 0, 0.0

    run = JobRun(client, spec, on_created=on_created, handle=handle, redactor=redactor, keep_on_success=True)
    steps = standby_steps(run, standby, standby_command)
    steps.pop("fresh", None)  # a detached launch is not folded
    outcome = run.run(execute=launch, collect=False, **steps)
    if not outcome.ok:
        return outcome
    assert outcome.sandbox_id is not None
    return DetachedJob(sandbox_id=outcome.sandbox_id, started_at=started[0], timeout=spec.timeout)


def poll_detached(client: pandastack.Client, sandbox_id: str) -> int | None:
    """The detached job's exit code, or None while it runs. Raises :class:`SandboxGone`."""
    sb = Sandbox.from_dict({"id": sandbox_id}, client=client)  # a handle on its files: no lookup
    try:
        sb.filesystem.stat(guest.DETACHED_EXIT)
    except pandastack.NotFoundError as exc:
        if "file does not exist" in str(exc).lower():
            return None
        raise SandboxGone(f"sandbox {sandbox_id} is gone: {exc}") from exc
    raw = sb.filesystem.read(guest.DETACHED_EXIT).decode(errors="replace").strip()
    try:
        return int(raw)
    except ValueError:
        return None  # written but not yet complete: the next poll reads it


def finish_detached(
    client: pandastack.Client,
    spec: JobSpec,
    job: DetachedJob,
    *,
    handle: JobHandle | None = None,
    redactor: Redactor | None = None,
    on_output: OutputCallback | None = None,
) -> JobOutcome:
    """Read the detached job's end, collect its result and delete its sandbox.

    Called when the exit marker appeared, the deadline passed, or the sandbox
    vanished; each of those becomes the matching outcome. The job's output
    (the last 64 KiB of each stream, redacted) goes to ``on_output`` once, here.
    ``handle.cancel()`` deletes the sandbox and ends the job as cancelled.
    """

    def acquire() -> Sandbox:
        try:
            return client.sandboxes.get(job.sandbox_id)
        except pandastack.NotFoundError:
            raise StepError(
                FailureKind.SANDBOX_LOST, f"sandbox {job.sandbox_id} vanished while the job ran"
            ) from None

    def read_end(sb: Sandbox) -> tuple[int, float]:
        for path, stream in ((guest.DETACHED_STDOUT, "stdout"), (guest.DETACHED_STDERR, "stderr")):
            try:
                run.output(stream, _output_tail(sb, path))
            except pandastack.PandastackError:
                pass
        try:
            code = poll_detached(client, job.sandbox_id)
        except SandboxGone as exc:
            raise StepError(FailureKind.SANDBOX_LOST, str(exc)) from None
        elapsed = time.time() - job.started_at
        if code is None:
            # Past the deadline with no exit marker: the guest clock never fired.
            return guest.TIMEOUT_EXIT_CODE, max(elapsed, spec.timeout)
        return code, elapsed

    run = JobRun(client, spec, handle=handle, redactor=redactor, on_output=on_output)
    return run.run(acquire=acquire, deliver=False, execute=read_end)


# What finish_detached reads back of each captured stream: its last 64 KiB.
OUTPUT_TAIL_BYTES = 65536


def _output_tail(sb: Sandbox, path: str) -> str:
    """The last :data:`OUTPUT_TAIL_BYTES` of a detached job's captured stream, never more read.

    A small regular file is read whole; a larger one is cut in the guest (``tail -c``, under its
    own short clock), since a GET of a file the job wrote reads as much as the job wrote
    (gigabytes on a server without the local one's read cap). Anything else is no output."""
    info = sb.filesystem.stat(path)
    if info.is_dir or not _is_regular(info.mode):
        return ""
    if info.size <= OUTPUT_TAIL_BYTES:
        return sb.filesystem.read(path)[-OUTPUT_TAIL_BYTES:].decode(errors="replace")
    res = sb.exec(f"timeout 10 tail -c {OUTPUT_TAIL_BYTES} {path}", timeout_seconds=30)
    return (res.stdout or "")[-OUTPUT_TAIL_BYTES:]
