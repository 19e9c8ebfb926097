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

import base64
import json
import math
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

import pandastack
from airflow.sdk import BaseOperator, ObjectStoragePath
from airflow.sdk.exceptions import AirflowFailException

from pandastack_jobs import (
    RESULT_PATH,
    Classifier,
    DetachedJob,
    JobHandle,
    JobKey,
    JobOutcome,
    JobSpec,
    JobSpecError,
    delete_sandbox,
    finish_detached,
    run_job,
    start_detached,
)
from pandastack_jobs.spec import DEFAULT_TEMPLATE, DEFAULT_TIMEOUT, FileContent

from ..exceptions import exception_for
from ..hooks.pandastack import PandaStackHook
from ..retry import pandastack_retry_policy

if TYPE_CHECKING:
    from airflow.sdk import Context

ENGINE = "airflow"
STATE_KEY = "pandastack_sandbox_id"
"""``task_state_store`` key holding the sandbox of the running try (read and reaped by the next try)."""
DEFAULT_XCOM_MAX_BYTES = 48 * 1024
MAX_LOG_LINE = 8192


def job_key(context: Context) -> JobKey:
    """The attempt this task try is, in the core's terms."""
    ti = context["ti"]
    map_index = getattr(ti, "map_index", -1)
    return JobKey(
        engine=ENGINE,
        workflow=ti.dag_id,
        task=ti.task_id,
        run=ti.run_id,
        map_index=-1 if map_index is None else int(map_index),
        try_number=int(ti.try_number),
    )


def reap_recorded(log: Any, context: Context, client: pandastack.Client) -> str | None:
    """Delete the sandbox an earlier try recorded in ``task_state_store`` (it died before its
    ``finally``); return its id. The core also reaps every sandbox labelled with an earlier try."""
    store = context.get("task_state_store")
    if store is None:
        return None
    try:
        previous = store.get(STATE_KEY)
    except Exception as exc:  # noqa: BLE001 - reaping is best effort; the metadata sweep remains
        log.warning("PandaStack: could not read task_state_store: %s", exc)
        return None
    if not previous:
        return None
    if delete_sandbox(client, str(previous)):
        log.warning("PandaStack: deleted sandbox %s left behind by an earlier try", previous)
    try:
        store.delete(STATE_KEY)
    except Exception as exc:  # noqa: BLE001
        log.warning("PandaStack: could not clear task_state_store: %s", exc)
    return str(previous)


class TaskLogStream:
    """Feeds the job's output into the task log, one line at a time, as it arrives."""

    def __init__(self, log: Any) -> None:
        self._log = log
        self._partial: dict[str, str] = {"stdout": "", "stderr": ""}

    def __call__(self, stream: str, chunk: str) -> None:
        text = self._partial.get(stream, "") + chunk
        *lines, rest = text.split("\n")
        for line in lines:
            self._emit(stream, line)
        if len(rest) > MAX_LOG_LINE:
            self._emit(stream, rest)
            rest = ""
        self._partial[stream] = rest

    def flush(self) -> None:
        for stream, rest in self._partial.items():
            if rest:
                self._emit(stream, rest)
            self._partial[stream] = ""

    def _emit(self, stream: str, line: str) -> None:
        line = line.rstrip("\r")
        if len(line) > MAX_LOG_LINE:
            line = line[:MAX_LOG_LINE] + "…"
        if stream == "stderr":
            self._log.warning("[sandbox stderr] %s", line)
        else:
            self._log.info("[sandbox stdout] %s", line)


class PandaStackSandboxOperator(BaseOperator):
    """Run ``command`` in a fresh PandaStack sandbox; its ``result.json`` is the task's XCom.

    :param command: shell command run in ``/work`` inside the sandbox (templated).
    :param files: ``{path: content}`` written into the sandbox before the command;
        relative paths land under ``/work``. Content is ``str``, ``bytes`` or a
        ``pathlib.Path`` to a local file. Not templated: code often contains ``{{``.
    :param input: JSON value written to ``/work/input.json`` (``$JOB_INPUT``) (templated).
    :param template: sandbox template (templated).
    :param timeout: the job's hard clock in seconds, enforced inside the guest.
    :param ttl: the sandbox's idle backstop; default ``timeout`` + 60 s.
    :param result_path: where the job writes its JSON result (``$JOB_RESULT``);
        ``None`` when the job has no result (templated).
    :param collect: more sandbox paths read back as files (templated).
    :param metadata: extra sandbox metadata, ``{str: str}`` (templated).
    :param env: environment variables for the job (templated). Never put the
        PandaStack key here; the sandbox must not see it.
    :param permanent_exit_codes: exit codes that mean "this input will never
        work": the task fails at once, no retry (dead-letter).
    :param retry_on_timeout: ``False`` dead-letters a job that ran out of time.
    :param deferrable: start the job detached and free the worker slot while it
        runs; a trigger polls for its end.
    :param poll_interval: seconds between the trigger's polls (deferrable).
    :param object_storage_path: base ``ObjectStoragePath`` URL (e.g.
        ``file:///data/pandastack`` or ``s3://bucket/prefix``) for collected files
        and results over ``xcom_max_bytes``; XCom then carries their path (templated).
    :param object_storage_conn_id: Airflow connection for that storage, if it needs one.
    :param xcom_max_bytes: the largest file or result pushed to XCom as a value.
    :param log_output: stream the job's stdout/stderr into the task log.
    :param pandastack_conn_id: the ``pandastack`` connection.

    Retries follow the redelivery table: the operator's default ``retry_policy``
    is :data:`~airflow_provider.retry.pandastack_retry_policy`.
    """

    template_fields: Sequence[str] = (
        "command",
        "input",
        "template",
        "result_path",
        "collect",
        "metadata",
        "env",
        "object_storage_path",
    )
    template_fields_renderers = {"input": "json", "metadata": "json", "env": "json", "command": "bash"}
    ui_color = "#fde8c8"

    def __init__(
        self,
        *,
        command: str,
        files: Mapping[str, FileContent] | None = None,
        input: Any = None,
        template: str = DEFAULT_TEMPLATE,
        timeout: float = DEFAULT_TIMEOUT,
        ttl: int | None = None,
        result_path: str | None = RESULT_PATH,
        collect: Sequence[str] = (),
        metadata: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        permanent_exit_codes: Sequence[int] = (),
        retry_on_timeout: bool = True,
        deferrable: bool = False,
        poll_interval: float = 2.0,
        object_storage_path: str | None = None,
        object_storage_conn_id: str | None = None,
        xcom_max_bytes: int = DEFAULT_XCOM_MAX_BYTES,
        log_output: bool = True,
        pandastack_conn_id: str = PandaStackHook.default_conn_name,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("retry_policy", pandastack_retry_policy)
        super().__init__(**kwargs)
        self.command = command
        self.files = dict(files or {})
        self.input = input
        self.template = template
        self.timeout = timeout
        self.ttl = ttl
        self.result_path = result_path
        self.collect = list(collect or ())
        self.metadata = dict(metadata or {})
        self.env = dict(env or {})
        # Validated here, at parse time: a bad code fails the DAG import, not a run.
        self.classifier = Classifier(
            permanent_exit_codes=frozenset(permanent_exit_codes), retry_on_timeout=retry_on_timeout
        )
        self.permanent_exit_codes = sorted(self.classifier.permanent_exit_codes)
        self.retry_on_timeout = retry_on_timeout
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
        self.pandastack_conn_id = pandastack_conn_id
        self._handle: JobHandle | None = None
        self._detached_id: str | None = None
        self._created_id: str | None = None
        self._killed = False

    # -- the job ---------------------------------------------------------------------------------

    @cached_property
    def hook(self) -> PandaStackHook:
        return PandaStackHook(pandastack_conn_id=self.pandastack_conn_id)

    def job_fields(self, context: Context) -> dict[str, Any]:
        """``command``, ``files``, ``input`` and ``result_path`` of the job (the decorator overrides)."""
        return {
            "command": self.command,
            "files": self.files,
            "input": self.input,
            "result_path": self.result_path,
        }

    def build_spec(self, context: Context) -> JobSpec:
        """The core job spec for this try. A bad spec fails the task at once (no retry can fix it)."""
        try:
            return JobSpec(
                **self.job_fields(context),
                collect=tuple(self.collect),
                template=self.template,
                timeout=self.timeout,
                ttl=self.ttl,
                metadata={str(k): str(v) for k, v in self.metadata.items()},
                env={str(k): str(v) for k, v in self.env.items()},
                key=job_key(context),
                classifier=self.classifier,
            )
        except JobSpecError as exc:
            raise AirflowFailException(f"PandaStack job is invalid: {exc}") from None

    def execute(self, context: Context) -> Any:
        spec = self.build_spec(context)
        client = self.hook.get_conn()
        self.reap_recorded(context, client)
        if self.deferrable:
            return self._execute_deferrable(context, client, spec)
        handle = self._handle = JobHandle()
        stream = TaskLogStream(self.log)
        try:
            # An AirflowTaskTimeout or SIGTERM mid-job propagates through the core, which deletes
            # the sandbox on its way out; on_kill cancels through the handle.
            outcome = self.run_spec(
                context,
                client,
                spec,
                on_created=self._created_callback(context),
                on_output=stream if self.log_output else None,
                handle=handle,
            )
        finally:
            stream.flush()
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
        """Delete the sandbox now; ``execute`` then sees a cancelled job and fails the task."""
        self._killed = True
        if self._handle is not None:
            self._handle.cancel()
        # Deferrable: the sandbox of a job being started or finished (the trigger owns it in between).
        for sandbox_id in {self._detached_id, self._created_id if self.deferrable else None} - {None}:
            delete_sandbox(self.hook.get_conn(), str(sandbox_id))
        self.log.warning("PandaStack: task killed; its sandbox was deleted")

    # -- deferrable ------------------------------------------------------------------------------

    def _execute_deferrable(self, context: Context, client: pandastack.Client, spec: JobSpec) -> Any:
        from ..triggers.sandbox import PandaStackJobTrigger

        started = start_detached(
            client,
            spec,
            on_created=self._created_callback(context),
            redactor=self.hook.redactor,
        )
        if isinstance(started, JobOutcome):  # could not start: already classified and cleaned up
            return self.finish(context, started)
        self._detached_id = started.sandbox_id
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
        self._detached_id = job.sandbox_id
        status = event.get("status")
        self.log.info("PandaStack: trigger reported %s for sandbox %s", status, job.sandbox_id)
        if event.get("message"):
            self.log.warning("PandaStack trigger: %s", event["message"])
        stream = TaskLogStream(self.log) if self.log_output else None
        outcome = finish_detached(
            self.hook.get_conn(), self.build_spec(context), job, redactor=self.hook.redactor, on_output=stream
        )
        self._detached_id = None
        if stream is not None:
            stream.flush()
        return self.finish(context, outcome)

    # -- translation -----------------------------------------------------------------------------

    def _created_callback(self, context: Context) -> Callable[[str], None]:
        store = context.get("task_state_store")
        ti = context["ti"]

        def created(sandbox_id: str) -> None:
            self._created_id = sandbox_id
            if store is not None:
                try:
                    store.set(STATE_KEY, sandbox_id)
                except Exception as exc:  # noqa: BLE001 - metadata reaping still covers this try
                    self.log.warning("PandaStack: could not record sandbox in task_state_store: %s", exc)
            ti.xcom_push(key="sandbox_id", value=sandbox_id)
            self.log.info("PandaStack: sandbox %s created (try %s)", sandbox_id, ti.try_number)

        return created

    def reap_recorded(self, context: Context, client: pandastack.Client) -> None:
        """Delete the sandbox an earlier try recorded in ``task_state_store``."""
        reap_recorded(self.log, context, client)

    def _forget_sandbox(self, context: Context, outcome: JobOutcome) -> None:
        store = context.get("task_state_store")
        if store is None or outcome.teardown_error is not None:
            return  # a sandbox we could not delete stays recorded for the next try to reap
        try:
            store.delete(STATE_KEY)
        except Exception as exc:  # noqa: BLE001
            self.log.warning("PandaStack: could not clear task_state_store: %s", exc)

    def finish(self, context: Context, outcome: JobOutcome) -> Any:
        """Outcome → XCom and the task's return value, or the matching exception."""
        ti = context["ti"]
        summary = outcome.summary()
        ti.xcom_push(key="pandastack", value=summary)
        ti.xcom_push(key="timings", value=summary["timings"])
        self._forget_sandbox(context, outcome)
        if outcome.teardown_error:
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
        if outcome.files:
            ti.xcom_push(key="files", value=self._publish_files(context, outcome.files))
        return self._publish_result(context, outcome)

    def _storage_base(self, context: Context) -> ObjectStoragePath | None:
        if not self.object_storage_path:
            return None
        key = job_key(context)
        base = ObjectStoragePath(self.object_storage_path, conn_id=self.object_storage_conn_id)
        parts = [key.workflow, key.run, key.task]
        if key.map_index >= 0:
            parts.append(f"map_{key.map_index}")
        parts.append(f"try_{key.try_number}")
        for part in parts:
            base = base / part.replace("/", "_")
        return base

    def _store(self, context: Context, name: str, data: bytes) -> str | None:
        base = self._storage_base(context)
        if base is None:
            return None
        target = base / name.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        self.log.info("PandaStack: stored %d bytes at %s", len(data), target)
        return str(target)

    def _publish_files(self, context: Context, files: Mapping[str, bytes]) -> dict[str, dict[str, Any]]:
        published: dict[str, dict[str, Any]] = {}
        for path, data in files.items():
            entry: dict[str, Any] = {"size": len(data)}
            if len(data) > self.xcom_max_bytes:
                uri = self._store(context, path, data)
                if uri is not None:
                    entry["path"] = uri
                    published[path] = entry
                    continue
                self.log.warning(
                    "PandaStack: %s is %d bytes (over xcom_max_bytes=%d) and no object_storage_path "
                    "is set; pushing it to XCom anyway",
                    path,
                    len(data),
                    self.xcom_max_bytes,
                )
            try:
                entry["text"] = data.decode("utf-8")
            except UnicodeDecodeError:
                entry["base64"] = base64.b64encode(data).decode("ascii")
            published[path] = entry
        return published

    def _publish_result(self, context: Context, outcome: JobOutcome) -> Any:
        if not outcome.has_result:
            return None
        raw = json.dumps(outcome.result).encode()
        if len(raw) > self.xcom_max_bytes:
            uri = self._store(context, "result.json", raw)
            if uri is not None:
                context["ti"].xcom_push(key="result_path", value=uri)
                self.log.info(
                    "PandaStack: result (%d bytes) is over xcom_max_bytes; XCom holds its path", len(raw)
                )
                return uri
        return outcome.result
