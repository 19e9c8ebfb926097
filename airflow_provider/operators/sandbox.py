"""``PandaStackSandboxOperator``: one throwaway PandaStack sandbox per task try.

The lifecycle (create → deliver → exec under a hard timeout → collect →
delete), the failure classification and the orphan reaping are the core's
(:mod:`pandastack_jobs`). This module only translates:

- the task try → a :class:`~pandastack_jobs.JobKey` (dag, task, run, map index,
  try), so the core reaps sandboxes of earlier tries before creating;
- the sandbox id → ``task_state_store`` right after create (the next try reaps
  it) and XCom ``sandbox_id``;
- the job's output → the task log, line by line, as it arrives;
- the outcome → XCom (``return_value`` = the job's ``result.json``; ``files``;
  ``pandastack`` = the redacted summary with timings), or an exception:
  redeliver → :class:`~airflow_provider.exceptions.PandaStackJobRedeliver`
  (retried), dead-letter → :class:`~airflow_provider.exceptions.PandaStackJobDeadLetter`
  (an ``AirflowFailException``);
- ``on_kill`` → :meth:`JobHandle.cancel`, which deletes the sandbox; the task
  then fails, never succeeds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pandastack

from pandastack_jobs import (
    DetachedJob,
    JobHandle,
    JobOutcome,
    JobSpec,
    LineSplitter,
    finish_detached,
    run_job,
    start_detached,
)

from ..attempt import ENGINE, STATE_KEY, forget_sandbox, job_key, reap_recorded, record_sandbox
from ..compat import AirflowFailException
from ..exceptions import exception_for
from ..publish import DEFAULT_XCOM_MAX_BYTES, Publisher
from .base import PandaStackJobBaseOperator

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = [
    "DEFAULT_XCOM_MAX_BYTES",
    "ENGINE",
    "STATE_KEY",
    "PandaStackSandboxOperator",
    "job_key",
    "reap_recorded",
    "task_log_lines",
]


def task_log_lines(log: Any) -> LineSplitter:
    """The core's line splitter feeding the task log (stderr as warnings), as output arrives."""

    def emit(stream: str, line: str) -> None:
        if stream == "stderr":
            log.warning("[sandbox stderr] %s", line)
        else:
            log.info("[sandbox stdout] %s", line)

    return LineSplitter(emit)


class PandaStackSandboxOperator(PandaStackJobBaseOperator):
    """Run ``command`` in a fresh PandaStack sandbox; its ``result.json`` is the task's XCom.

    ``command``, ``files``, ``input`` and ``pandastack_conn_id`` are
    :class:`~airflow_provider.operators.base.PandaStackJobBaseOperator`'s.

    :param deferrable: start the job detached and free the worker slot while it
        runs; a trigger polls for its end.
    :param poll_interval: seconds between the trigger's polls (deferrable).
    :param object_storage_path: base ``ObjectStoragePath`` URL (e.g.
        ``file:///data/pandastack`` or ``s3://bucket/prefix``) for collected files
        and results over ``xcom_max_bytes``; XCom then carries their path (templated).
    :param object_storage_conn_id: Airflow connection for that storage, if it needs one (templated).
    :param xcom_max_bytes: the largest file or result pushed to XCom as a value.
    :param log_output: stream the job's stdout/stderr into the task log.

    The job's options (``template``, ``timeout``, ``ttl``, ``result_path``,
    ``collect``, ``metadata``, ``env``, ``permanent_exit_codes``,
    ``retry_on_timeout``, ``max_result_bytes``, ``max_file_bytes``) are keyword
    parameters too, all templated: :func:`pandastack_jobs.job_options` declares
    them, docs/airflow.md lists them. Never put the PandaStack key in ``env``.

    Retries follow the redelivery table: the operator's default ``retry_policy``
    is :data:`~airflow_provider.retries.pandastack_retry_policy`.
    """

    template_fields: Sequence[str] = (
        *PandaStackJobBaseOperator.template_fields,
        "object_storage_path",
        "object_storage_conn_id",
    )
    ui_color = "#fde8c8"

    def __init__(
        self,
        *,
        deferrable: bool = False,
        poll_interval: float = 2.0,
        object_storage_path: str | None = None,
        object_storage_conn_id: str | None = None,
        xcom_max_bytes: int = DEFAULT_XCOM_MAX_BYTES,
        log_output: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.deferrable = deferrable
        if (
            not isinstance(poll_interval, (int, float))
            or not math.isfinite(poll_interval)
            or poll_interval <= 0
        ):
            raise ValueError(f"poll_interval: {poll_interval!r} is not a positive number of seconds")
        self.poll_interval = float(poll_interval)
        self.object_storage_path = object_storage_path
        self.object_storage_conn_id = object_storage_conn_id
        if not isinstance(xcom_max_bytes, int) or xcom_max_bytes < 0:
            raise ValueError(f"xcom_max_bytes: {xcom_max_bytes!r} is not a size in bytes")
        self.xcom_max_bytes = xcom_max_bytes
        self.log_output = log_output
        self._handle: JobHandle | None = None
        self._killed = False

    # -- the job ---------------------------------------------------------------------------------

    def execute(self, context: Context) -> Any:
        spec = self.build_spec(context)
        client = self.hook.get_conn()
        self.reap_recorded(context, client)
        handle = self._handle = JobHandle()
        if self.deferrable:
            return self._execute_deferrable(context, client, spec, handle)
        lines = task_log_lines(self.log)
        try:
            # An AirflowTaskTimeout or SIGTERM mid-job propagates through the core, which deletes
            # the sandbox on its way out; on_kill cancels through the handle.
            outcome = self.run_spec(
                context,
                client,
                spec,
                on_created=self._created_callback(context),
                on_output=lines if self.log_output else None,
                handle=handle,
            )
        finally:
            lines.flush()
        return self.finish(context, outcome)

    def run_spec(
        self,
        context: Context,
        client: pandastack.Client,
        spec: JobSpec,
        *,
        on_created: Callable[[str], None],
        on_output: Callable[[str, str], None] | None,
        handle: JobHandle,
    ) -> JobOutcome:
        """Run the job in one fresh sandbox (the fork operator runs it in a fork instead)."""
        return run_job(
            client,
            spec,
            on_created=on_created,
            on_output=on_output,
            handle=handle,
            redactor=self.hook.redactor,
        )

    def on_kill(self) -> None:
        """Delete the sandbox now; ``execute`` then sees a cancelled job and fails the task.

        Deferrable: while the job is being started or finished, the handle holds its sandbox;
        in between the trigger owns it (and its ``on_kill`` deletes it)."""
        self._killed = True
        if self._handle is not None:
            self._handle.cancel()
        self.log.warning("task killed; its sandbox was deleted")

    # -- deferrable ------------------------------------------------------------------------------

    def _execute_deferrable(
        self, context: Context, client: pandastack.Client, spec: JobSpec, handle: JobHandle
    ) -> Any:
        from ..triggers.sandbox import PandaStackJobTrigger

        started = start_detached(
            client,
            spec,
            on_created=self._created_callback(context),
            handle=handle,
            redactor=self.hook.redactor,
        )
        if isinstance(started, JobOutcome):  # could not start: already classified and cleaned up
            return self.finish(context, started)
        self.log.info(
            "PandaStack: job started detached in sandbox %s; deferring (deadline in %.0fs)",
            started.sandbox_id,
            started.deadline - started.started_at,
        )
        self.defer(
            trigger=PandaStackJobTrigger(
                job=started.to_dict(),
                pandastack_conn_id=self.pandastack_conn_id,
                poll_interval=self.poll_interval,
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        """Resume after the trigger fired: collect the result and delete the sandbox."""
        job = DetachedJob.from_dict(event["job"])
        status = event.get("status")
        self.log.info("trigger reported %s for sandbox %s", status, job.sandbox_id)
        if event.get("message"):
            self.log.warning("trigger: %s", event["message"])
        lines = task_log_lines(self.log) if self.log_output else None
        handle = self._handle = JobHandle()
        outcome = finish_detached(
            self.hook.get_conn(),
            self.build_spec(context),
            job,
            handle=handle,
            redactor=self.hook.redactor,
            on_output=lines,
        )
        if lines is not None:
            lines.flush()
        return self.finish(context, outcome)

    # -- translation -----------------------------------------------------------------------------

    def _created_callback(self, context: Context) -> Callable[[str], None]:
        ti = context["ti"]

        def created(sandbox_id: str) -> None:
            record_sandbox(self.log, context, sandbox_id)
            ti.xcom_push(key="sandbox_id", value=sandbox_id)
            self.log.info("sandbox %s created (try %s)", sandbox_id, ti.try_number)

        return created

    def reap_recorded(self, context: Context, client: pandastack.Client) -> None:
        """Delete the sandbox an earlier try recorded in ``task_state_store``."""
        reap_recorded(self.log, context, client)

    def finish(self, context: Context, outcome: JobOutcome) -> Any:
        """Outcome → XCom and the task's return value, or the matching exception."""
        ti = context["ti"]
        summary = outcome.summary()
        ti.xcom_push(key="pandastack", value=summary)
        ti.xcom_push(key="timings", value=summary["timings"])
        if outcome.teardown_error is None:
            forget_sandbox(self.log, context)  # one we could not delete stays for the next try
        else:
            self.log.warning(
                "PandaStack: sandbox not deleted (the TTL will reap it): %s", outcome.teardown_error
            )
        if self._killed:
            raise AirflowFailException(
                f"PandaStack job was killed (sandbox {outcome.sandbox_id} deleted); not marking it a success"
            )
        if not outcome.ok:
            error = exception_for(outcome)
            self.log.error("%s", error)
            raise error
        self.log.info(
            "PandaStack: job succeeded in sandbox %s (%s)",
            outcome.sandbox_id,
            ", ".join(f"{k} {v:.2f}s" for k, v in summary["timings"].items()),
        )
        publish = Publisher(
            self.log, context, self.object_storage_path, self.object_storage_conn_id, self.xcom_max_bytes
        )
        # Always pushed ({} when nothing was collected): a downstream pull never finds it missing.
        ti.xcom_push(key="files", value=publish.files(outcome.files) if outcome.files else {})
        return publish.result(outcome)
