"""Running one job from inside a Prefect run: the translation layer every entry point shares.

It names the attempt (so the core reaps earlier attempts), waits out a
redelivery delay, holds an optional global concurrency slot, streams the job's
redacted output to the run logger, calls the core lifecycle, and turns the
outcome into artifacts and either a return value or a :class:`SandboxJobFailed`.
The lifecycle itself (create, deliver, exec, collect, delete) is the core's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import pandastack
from prefect.context import TaskRunContext
from prefect.exceptions import MissingContextError
from prefect.logging import get_logger, get_run_logger

from pandastack_jobs import (
    JobHandle,
    JobOutcome,
    JobSpec,
    LineSplitter,
    Redactor,
    coerce_options,
    job_option,
    run_job,
)
from pandastack_jobs.lifecycle import OutputCallback

from .artifacts import publish_dead_letter, publish_outcome
from .credentials import PandaStackCredentials, resolve_credentials
from .exceptions import SandboxJobFailed
from .keys import artifact_key, current_job_key, fingerprint, reap_dead_flow_attempts
from .retries import wait_for_redelivery

MAX_LOGGED_LINES = 2000

Runner = Callable[..., JobOutcome]
"""``runner(client, spec, *, on_created, on_output, handle, redactor) -> JobOutcome``."""


def run_logger() -> Any:
    try:
        return get_run_logger()
    except MissingContextError:
        return get_logger(__name__)


def line_logger(log: Any) -> LineSplitter:
    """The core's line splitter feeding ``log`` (stderr as warnings), capped per stream."""

    def emit(stream: str, line: str) -> None:
        log.log(logging.WARNING if stream == "stderr" else logging.INFO, "[%s] %s", stream, line)

    return LineSplitter(emit, max_lines=MAX_LOGGED_LINES)


@dataclass(frozen=True)
class JobRequest:
    """One job as a Prefect entry point hands it over: the core's :class:`JobSpec`, built once
    (by :meth:`PandaStackSandbox.request <prefect_blocks.PandaStackSandbox.request>`) and keyed
    to the attempt, and Prefect's own fields beside it."""

    spec: JobSpec
    credentials: Optional[PandaStackCredentials] = None
    concurrency_limit: Optional[str] = None
    publish_artifacts: bool = True
    job_name: Optional[str] = None
    artifact_key: Optional[str] = None

    @property
    def command(self) -> str:
        return self.spec.command

    def credentials_or_default(self) -> PandaStackCredentials:
        return resolve_credentials(self.credentials)

    def name(self) -> str:
        return job_name(self.job_name)


def job_name(given: Optional[str]) -> str:
    """A job's name: the one given, else the current task's, else ``pandastack-job``."""
    if given:
        return given
    ctx = TaskRunContext.get()
    return ctx.task.name if ctx is not None else "pandastack-job"


def build_spec(
    command: str, files: Mapping[str, Any], input: Any, options: Mapping[str, Any], name: str
) -> JobSpec:
    """The core's job spec, once: ``options`` coerced (text forms read) and the attempt's key."""
    coerced = coerce_options(options)
    template = coerced.get("template", job_option("template").default)
    fp = fingerprint(command, files, input, template)
    return JobSpec(command=command, files=dict(files), input=input, key=current_job_key(name, fp), **coerced)


@contextlib.contextmanager
def concurrency_slot(name: Optional[str], log: Any) -> Iterator[None]:
    """Hold one slot of Prefect global concurrency limit ``name`` (no-op without a name)."""
    if not name:
        yield
        return
    from prefect.concurrency.sync import concurrency

    log.debug("pandastack: waiting for a slot of concurrency limit %r", name)
    with concurrency(name, occupy=1):
        yield


def execute(
    request: JobRequest,
    *,
    handle: Optional[JobHandle] = None,
    runner: Optional[Runner] = None,
    wait_for_retry: bool = True,
) -> JobOutcome:
    """Run ``request`` in one fresh sandbox; return the outcome or raise :class:`SandboxJobFailed`."""
    log = run_logger()
    task_ctx = TaskRunContext.get()
    if wait_for_retry and task_ctx is not None:
        wait_for_redelivery(task_ctx.task_run.id, log)
    spec = request.spec
    credentials = request.credentials_or_default()
    redactor = credentials.redactor()
    client: pandastack.Client = credentials.get_client()
    redactor.add(getattr(client, "api_key", None))
    if reaped := reap_dead_flow_attempts(client, spec.key):
        log.info("pandastack: deleted %d sandbox(es) earlier flow run attempts left: %s", len(reaped), reaped)
    handle = handle or JobHandle()
    lines = line_logger(log)
    on_output: OutputCallback = lines

    def on_created(sandbox_id: str) -> None:
        attempt = spec.key.try_number if spec.key else "-"
        log.info(
            "pandastack: job running in sandbox %s (template %s, attempt %s)",
            sandbox_id,
            spec.template,
            attempt,
        )

    run = runner or run_job
    with concurrency_slot(request.concurrency_limit, log):
        try:
            outcome = run(
                client, spec, on_created=on_created, on_output=on_output, handle=handle, redactor=redactor
            )
        except BaseException:
            # A signal, a cancellation or a bug: the core's teardown may not have run.
            handle.cancel()
            raise
        finally:
            lines.flush()
            # Its pooled connection, now: a failed task's traceback keeps this frame (and so the
            # client) as long as Prefect keeps the state, one idle socket per failed job.
            close_client(client)
    return finish(request, spec, outcome, redactor, log)


def close_client(client: Any) -> None:
    """Close an SDK client's HTTP session (its pooled sockets); a later request would reopen one."""
    session = getattr(client, "session", None)
    if session is not None:
        session.close()


def finish(
    request: JobRequest, spec: JobSpec, outcome: JobOutcome, redactor: Redactor, log: Any
) -> JobOutcome:
    """Publish artifacts and translate the outcome: return it on success, raise otherwise."""
    key = request.artifact_key or artifact_key(request.name())
    if outcome.teardown_error:
        log.warning(
            "pandastack: sandbox %s not deleted (TTL will reap it): %s",
            outcome.sandbox_id,
            outcome.teardown_error,
        )
    if outcome.ok:
        log.info(
            "pandastack: job succeeded in %.1fs (sandbox %s deleted)",
            outcome.timings.total,
            outcome.sandbox_id,
        )
        if request.publish_artifacts:
            attempt = f"{spec.key.job_id}/{spec.key.try_number}" if spec.key else "adhoc"
            prefix = f"pandastack/{attempt}"
            publish_outcome(outcome, key, redactor, storage_prefix=prefix)
        return outcome
    error = SandboxJobFailed.from_outcome(outcome)
    if outcome.dead_letter:
        log.error("pandastack: job dead-lettered (no retry): %s", outcome.reason)
        if request.publish_artifacts:
            publish_dead_letter(outcome, key, redactor, command=request.command, template=spec.template)
    else:
        if outcome.retry_after is not None:
            log.warning(
                "pandastack: job refused for capacity, redeliverable after at least %ss: %s",
                outcome.retry_after,
                outcome.reason,
            )
        else:
            log.warning("pandastack: job failed, redeliverable: %s", outcome.reason)
    raise error
