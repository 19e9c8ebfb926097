"""``PandaStackExecutor``: every task try in its own fresh PandaStack sandbox.

An Airflow 3.3 executor in the shape of Airflow's ``common.sandbox`` engine: the
scheduler hands over an ``ExecuteTask`` workload, the executor launches Airflow's
standard Task SDK workload command (``python -m airflow.sdk.execution_time.execute_workload``)
in a fresh sandbox through a :class:`~airflow_provider.executors.driver.SandboxDriver`,
polls it, and reports the end. The task itself talks to the Execution API with its
task-scoped token, exactly as on a Celery or Kubernetes worker.

Identity: the task try's UUID (Airflow pre-assigns it, ``pre_assigns_external_executor_id``)
is on the sandbox's metadata; once launched, a :class:`SandboxExecutionRef` with the
handle is persisted in ``external_executor_id`` so a replacement scheduler adopts the
sandbox, and a try whose handle never got persisted is fenced (all its sandboxes
deleted) before Airflow reschedules it. A try that ended while no scheduler watched it
(its TI is finished, so nobody adopts it) is found by the orphan sweep, which copies
its task log out and deletes its sandbox.

Configuration lives in the ``[pandastack_executor]`` section; a task overrides
``template``, ``timeout``, ``ttl`` and ``env`` with ``executor_config={"pandastack": {...}}``.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
import time
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from airflow.executors.base_executor import BaseExecutor, get_execution_api_server_url
from airflow.executors.workloads import ExecuteTask

from pandastack_jobs import Redactor

from .driver import PandaStackDriver, SandboxDriver
from .hints import failure_hint
from .models import (
    SandboxCapacityError,
    SandboxConfigurationError,
    SandboxExecutionRef,
    SandboxHandle,
    SandboxLaunchConfig,
    SandboxLaunchRequest,
    SandboxOutput,
    SandboxResult,
    SandboxState,
    is_preassigned_executor_id,
)

if TYPE_CHECKING:
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.taskinstancekey import TaskInstanceKey

T = TypeVar("T")

CONFIG_SECTION = "pandastack_executor"
# Beside an executor that does not pre-assign the try's UUID, Airflow gives it only to tasks whose
# executor= is the configured alias or module path: configure this alias to use the short name.
ALIAS = "PandaStackExecutor"
ALIAS_CONFIG = f"{ALIAS}:airflow_provider.executors.PandaStackExecutor"
WORKLOAD_MODULE = "airflow.sdk.execution_time.execute_workload"
# Inside the sandbox: Airflow's home and the task log folder live in the throwaway work dir.
GUEST_AIRFLOW_HOME = "/work/airflow"
GUEST_LOG_FOLDER = "/work/logs"
MAX_TASK_LOG_BYTES = 8 * 1024 * 1024
FAILURE_TAIL_LINES = 20
MAX_POLL_INTERVAL = 30.0
# The orphan sweep leaves a finished try's sandbox this long to the executor that owns it
# (another scheduler of an HA pair deletes it within a poll or two of the end).
ORPHAN_GRACE_SECONDS = 60.0
WORKER_CLIENT_OPTIONS = (
    "execution_api_timeout",
    "execution_api_retries",
    "execution_api_retry_wait_min",
    "execution_api_retry_wait_max",
)


class _Loop:
    """An asyncio loop on a daemon thread: driver coroutines run there, the scheduler gets futures.

    Concurrency toward the API is bounded by one semaphore, so a burst of queued tasks
    cannot open hundreds of connections at once.
    """

    def __init__(self, concurrency: int) -> None:
        self._loop = asyncio.new_event_loop()
        self._limit = asyncio.Semaphore(concurrency)
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="pandastack-executor", daemon=True
        )
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        async def bounded() -> T:
            async with self._limit:
                return await coro

        return asyncio.run_coroutine_threadsafe(bounded(), self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        return self.submit(coro).result(timeout=timeout)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


@dataclass(frozen=True)
class _Launch:
    key: TaskInstanceKey
    request_id: str
    workload: ExecuteTask


@dataclass(frozen=True)
class _Finish:
    key: TaskInstanceKey
    ref: SandboxExecutionRef
    result: SandboxResult


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


class PandaStackExecutor(BaseExecutor):
    """Runs each task try in its own throwaway PandaStack sandbox (Airflow's sandbox-executor contract)."""

    is_local = False
    is_production = True
    serve_logs = False
    supports_ad_hoc_ti_run = False
    pre_assigns_external_executor_id: ClassVar[bool] = True
    driver_id: ClassVar[str] = PandaStackDriver.driver_id
    config_section: ClassVar[str] = CONFIG_SECTION

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        section = self.config_section
        get = self.conf.get
        self.conn_id = (
            get(section, "pandastack_conn_id", fallback="pandastack_default") or "pandastack_default"
        )
        self.python = get(section, "python", fallback=None) or sys.executable
        self.execution_api_url = get(section, "execution_api_server_url", fallback=None) or (
            get_execution_api_server_url(self.conf)
        )
        self.dags_folder: str = (
            get(section, "dags_folder", fallback=None) or get("core", "dags_folder", fallback="") or ""
        )
        self.poll_interval = float(get(section, "poll_interval", fallback="1") or 1)
        self.launch_concurrency = self.conf.getint(section, "launch_concurrency", fallback=8)
        self.adoption_timeout = float(get(section, "adoption_timeout", fallback="30") or 30)
        self.shutdown_timeout = float(get(section, "shutdown_timeout", fallback="30") or 30)
        self.check_health = self.conf.getboolean(section, "check_health_on_startup", fallback=True)
        self.orphan_sweep_interval = float(get(section, "orphan_sweep_interval", fallback="60") or 0)
        timeout = self.conf.getint(section, "timeout", fallback=3600)
        ttl_text = get(section, "ttl", fallback=None)
        env_text = get(section, "env", fallback=None) or "{}"
        try:
            env = json.loads(env_text)
        except ValueError as exc:
            raise SandboxConfigurationError(
                f'[{section}] env: not JSON ({exc}); give an object, e.g. {{"TZ": "UTC"}}'
            ) from None
        self.launch_config = SandboxLaunchConfig(
            template=get(section, "template", fallback="code-interpreter") or "code-interpreter",
            timeout_seconds=timeout,
            ttl_seconds=int(ttl_text) if ttl_text else timeout + 300,
            env=env,
        )
        if self.poll_interval <= 0 or self.launch_concurrency <= 0:
            raise SandboxConfigurationError(f"[{section}] poll_interval and launch_concurrency must be > 0")
        self.base_log_folder = get("logging", "base_log_folder", fallback="") or ""
        self.driver: SandboxDriver | None = None
        self._loop: _Loop | None = None
        self._launching: dict[Future[SandboxExecutionRef], _Launch] = {}
        self._polling: dict[Future[SandboxResult], tuple[TaskInstanceKey, SandboxExecutionRef]] = {}
        self._finishing: dict[Future[tuple[bytes | None, SandboxOutput | None]], _Finish] = {}
        self._fencing: dict[Future[None], tuple[TaskInstanceKey | None, str, str]] = {}
        self._active: dict[TaskInstanceKey, SandboxExecutionRef] = {}
        self._next_poll: dict[TaskInstanceKey, float] = {}
        self._poll_failures: dict[TaskInstanceKey, int] = {}
        self._deferred: dict[TaskInstanceKey, tuple[float, ExecuteTask]] = {}
        self._revoked: set[TaskInstanceKey] = set()
        self._listing: Future[dict[str, dict[str, str]]] | None = None
        self._next_sweep = 0.0  # the first heartbeat sweeps: a restarted scheduler cleans up at once
        self._collecting: dict[Future[bytes | None], tuple[str, SandboxExecutionRef | None]] = {}

    # -- start / driver --------------------------------------------------------------------------

    def make_driver(self) -> SandboxDriver:
        """The driver, with the PandaStack key resolved here, in the scheduler (never in a sandbox)."""
        from airflow.models.connection import Connection

        from airflow_provider.hooks.pandastack import config_from_connection

        try:
            conn = Connection.get_connection_from_secrets(self.conn_id)
        except Exception:
            if self.conn_id != "pandastack_default":
                raise
            conn = None
        config = config_from_connection(conn)  # type: ignore[arg-type]
        return PandaStackDriver(config, redactor=Redactor([config.api_key]))

    def start(self) -> None:
        self.driver = self.make_driver()
        self._loop = _Loop(self.launch_concurrency)
        if self.check_health:
            try:
                self._loop.run(self.driver.health_check(), timeout=30)
            except Exception:
                self._loop.close()
                self._loop = None
                raise

    def _submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        if self._loop is None:
            coro.close()
            raise RuntimeError("PandaStackExecutor.start() must run before tasks are queued")
        return self._loop.submit(coro)

    # -- queue → launch --------------------------------------------------------------------------

    def workload_command(self, workload: ExecuteTask) -> list[str]:
        """Airflow's standard Task SDK workload command, as Kubernetes and sandbox executors run it."""
        return [self.python, "-m", WORKLOAD_MODULE, "--json-string", workload.model_dump_json()]

    def runtime_env(self, task_env: dict[str, str]) -> dict[str, str]:
        """What the sandbox's environment holds: the task's env plus the Airflow runtime variables.

        Nothing else: no metadata DB URL, no fernet key, no PandaStack key. The only
        credential is the workload's own task-scoped Execution API token.
        """
        env = dict(task_env)
        env.update(
            {
                "AIRFLOW_HOME": GUEST_AIRFLOW_HOME,
                "AIRFLOW_IS_EXECUTOR_CONTAINER": "true",
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": self.execution_api_url,
                "AIRFLOW__CORE__DAGS_FOLDER": self.dags_folder,
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__LOGGING__BASE_LOG_FOLDER": GUEST_LOG_FOLDER,
                # The sandbox parses the DAG again and checks every task's executor= against this
                # list: without it a task with executor="PandaStackExecutor" never loads there.
                "AIRFLOW__CORE__EXECUTOR": self.conf.get("core", "executor", fallback="") or "",
            }
        )
        # The Task SDK's API client settings, as the workers here have them (no secrets in them).
        for option in WORKER_CLIENT_OPTIONS:
            value = self.conf.get("workers", option, fallback=None)
            if value:
                env[f"AIRFLOW__WORKERS__{option.upper()}"] = str(value)
        return env

    def launch_request(self, workload: ExecuteTask) -> SandboxLaunchRequest:
        """Validate the task's options and build its launch request (raises a clear config error)."""
        ti = workload.ti
        request_id = ti.external_executor_id
        if not is_preassigned_executor_id(request_id):
            raise SandboxConfigurationError(
                f"task {ti.key} has no pre-assigned external_executor_id (the try's UUID). Beside an "
                "executor that does not pre-assign one (LocalExecutor, KubernetesExecutor), Airflow "
                "pre-assigns it only when the task's executor= is the configured name: configure "
                f"[core] executor = ...,{ALIAS_CONFIG} and use executor={ALIAS!r} (needs Airflow >= 3.3)"
            )
        config = self.launch_config.overlay(ti.executor_config)
        return SandboxLaunchRequest(
            request_id=str(request_id),
            command=tuple(self.workload_command(workload)),
            env=self.runtime_env(dict(config.env)),
            config=config,
            labels={
                "dag_id": ti.dag_id,
                "task_id": ti.task_id,
                "run_id": ti.run_id,
                "map_index": str(ti.map_index),
                "try_number": str(ti.try_number),
            },
        )

    async def _launch(self, request: SandboxLaunchRequest, log_path: str | None) -> SandboxExecutionRef:
        assert self.driver is not None
        try:
            handle = await self.driver.launch(request)
            self.driver.validate_handle(handle, request_id=request.request_id)
        except BaseException:
            # A create may have gone through before the error: nothing of this try may keep running.
            try:
                await self.driver.fence(request.request_id)
            except Exception:  # noqa: BLE001 - the TTL backstop and a later fence catch it
                self.log.warning("could not fence request %s after a failed launch", request.request_id)
            raise
        data = {**handle.data, "log_path": log_path} if log_path else dict(handle.data)
        return SandboxExecutionRef(
            self.driver_id, request.request_id, SandboxHandle(data, display_name=handle.display_name)
        )

    def _process_workloads(self, workload_items: Sequence[Any]) -> None:
        for workload in workload_items:
            if not isinstance(workload, ExecuteTask):
                raise RuntimeError(f"{type(self).__name__} runs task workloads only, not {type(workload)}")
            key = workload.ti.key
            self.queued_tasks.pop(key, None)
            self.running.add(key)
            try:
                request = self.launch_request(workload)
            except (SandboxConfigurationError, ValueError) as exc:
                self.log.error("PandaStackExecutor: cannot run %s: %s", key, exc)
                self._write_task_log(
                    workload.log_path, None, [f"PandaStackExecutor: task not started: {exc}"]
                )
                self.fail(key, info=str(exc))
                continue
            future = self._submit(self._launch(request, workload.log_path))
            self._launching[future] = _Launch(key, request.request_id, workload)

    # -- the heartbeat ---------------------------------------------------------------------------

    def sync(self) -> None:
        self._drain_launches()
        self._drain_polls()
        self._drain_finishes()
        self._drain_fences()
        self._drain_collects()
        self._requeue_due()
        self._schedule_polls()
        self._sweep_orphans()

    def _drain_launches(self) -> None:
        for future, launch in list(self._launching.items()):
            if not future.done():
                continue
            del self._launching[future]
            key = launch.key
            try:
                ref = future.result()
            except SandboxCapacityError as exc:
                wait = exc.retry_after
                self.log.info("PandaStack refused %s for capacity; queued again in %.1fs", key, wait)
                self._deferred[key] = (time.monotonic() + wait, launch.workload)
                continue
            except Exception as exc:  # noqa: BLE001 - any launch error fails the try; retries apply
                self.log.error("PandaStackExecutor: launch of %s failed: %s", key, exc)
                self._write_task_log(launch.workload.log_path, None, [f"PandaStackExecutor: {exc}"])
                if key in self._revoked:
                    self._forget(key)
                else:
                    self.fail(key, info=str(exc))
                continue
            if key in self._revoked:
                self._start_fence(None, ref.request_id, "revoked during launch")
                self._forget(key)
                continue
            self._active[key] = ref
            self._next_poll[key] = 0.0
            self.running_state(key, info=ref.encode())  # persists the handle in external_executor_id

    def _requeue_due(self) -> None:
        now = time.monotonic()
        for key, (due, workload) in list(self._deferred.items()):
            if due <= now:
                del self._deferred[key]
                self.running.discard(key)
                self.queued_tasks[key] = workload

    def _schedule_polls(self) -> None:
        if self._loop is None or self.driver is None:
            return
        now = time.monotonic()
        busy = {key for key, _ in self._polling.values()}
        for key, ref in list(self._active.items()):
            if key in busy or self._next_poll.get(key, 0.0) > now:
                continue
            self._polling[self._submit(self.driver.get_status(ref.handle))] = (key, ref)

    def _defer_poll(self, key: TaskInstanceKey, failed: bool) -> None:
        failures = self._poll_failures.get(key, 0) + 1 if failed else 0
        self._poll_failures[key] = failures
        interval = min(self.poll_interval * (2 ** min(failures, 8)), MAX_POLL_INTERVAL)
        self._next_poll[key] = time.monotonic() + interval + random.uniform(0, interval / 10)  # noqa: S311

    def _drain_polls(self) -> None:
        for future, (key, ref) in list(self._polling.items()):
            if not future.done():
                continue
            del self._polling[future]
            if self._active.get(key) != ref:
                continue
            try:
                result = future.result()
            except Exception:
                self.log.warning("PandaStackExecutor: status of %s failed; polling again", key, exc_info=True)
                self._defer_poll(key, failed=True)
                continue
            if not result.terminal:
                self._defer_poll(key, failed=False)
                continue
            del self._active[key]
            self._next_poll.pop(key, None)
            self._poll_failures.pop(key, None)
            future_finish = self._submit(self._finish(ref, result))
            self._finishing[future_finish] = _Finish(key, ref, result)

    async def _finish(
        self, ref: SandboxExecutionRef, result: SandboxResult
    ) -> tuple[bytes | None, SandboxOutput | None]:
        """Bring the task log and (on failure) the output tail back, then delete the sandbox."""
        assert self.driver is not None
        log: bytes | None = None
        output: SandboxOutput | None = None
        if result.state is not SandboxState.GONE:
            log = await self._read_task_log(ref)
            if result.state is SandboxState.FAILED:
                try:
                    output = await self.driver.get_output(ref.handle)
                except Exception:
                    self.log.warning("could not read the output of %s", ref.request_id, exc_info=True)
        await self.driver.terminate(ref.handle)
        return log, output

    async def _read_task_log(self, ref: SandboxExecutionRef) -> bytes | None:
        assert self.driver is not None
        log_path = ref.handle.data.get("log_path")
        read_file = getattr(self.driver, "read_file", None)
        if not log_path or read_file is None:
            return None
        try:
            return await read_file(ref.handle, f"{GUEST_LOG_FOLDER}/{log_path}", MAX_TASK_LOG_BYTES)
        except Exception:  # the delete must still happen
            self.log.warning("could not read the task log of %s", ref.request_id, exc_info=True)
            return None

    def _drain_finishes(self) -> None:
        for future, finish in list(self._finishing.items()):
            if not future.done():
                continue
            del self._finishing[future]
            key, ref, result = finish.key, finish.ref, finish.result
            log: bytes | None = None
            output: SandboxOutput | None = None
            try:
                log, output = future.result()
            except Exception:
                self.log.warning("PandaStackExecutor: cleanup of %s failed; fencing", key, exc_info=True)
                self._start_fence(None, ref.request_id, "cleanup")
            lines: list[str] = []
            if result.state is not SandboxState.SUCCEEDED:
                lines = self._failure_lines(ref, result, output)
            self._write_task_log(ref.handle.data.get("log_path"), log, lines)
            if key in self._revoked:
                self._forget(key)
            elif result.state is SandboxState.SUCCEEDED:
                self.success(key)
            else:
                self.fail(key, info=lines[0] if lines else result.message)

    def _failure_lines(
        self, ref: SandboxExecutionRef, result: SandboxResult, output: SandboxOutput | None
    ) -> list[str]:
        sandbox = ref.handle.display_name or ref.request_id
        head = f"PandaStackExecutor: sandbox {sandbox}: {result.message or result.state.value}"
        if result.exit_code is not None and "exit code" not in head:
            head += f" (exit code {result.exit_code})"
        text = "" if output is None else output.stdout + "\n" + output.stderr
        if hint := failure_hint(result, text, self.python, self.execution_api_url):
            head += f"; {hint}"
        lines = [head]
        if output is not None:
            tail = (
                output.stdout + ("\n" if output.stdout and output.stderr else "") + output.stderr
            ).splitlines()
            tail = [line for line in tail if line.strip()][-FAILURE_TAIL_LINES:]
            if tail:
                lines.append(f"PandaStackExecutor: last {len(tail)} line(s) of the sandbox's output:")
                lines.extend(tail)
        return lines

    def _write_task_log(self, log_path: object, log: bytes | None, lines: list[str]) -> None:
        """Put the task's log (copied out of the sandbox) and the executor's lines where Airflow reads it."""
        if not isinstance(log_path, str) or not log_path or not self.base_log_folder:
            return
        base = Path(self.base_log_folder).resolve()
        target = (base / log_path).resolve()
        if base not in target.parents:
            self.log.warning("PandaStackExecutor: log path %r leaves the log folder; not written", log_path)
            return
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "ab" if log is None else "wb") as fh:
                if log is not None:
                    fh.write(log if log.endswith(b"\n") or not log else log + b"\n")
                for line in lines:
                    record = {
                        "timestamp": _now(),
                        "level": "error",
                        "logger": "PandaStackExecutor",
                        "event": line,
                    }
                    fh.write(json.dumps(record).encode() + b"\n")
        except OSError:
            self.log.warning("PandaStackExecutor: could not write the task log %s", target, exc_info=True)

    # -- fencing ---------------------------------------------------------------------------------

    def _start_fence(self, key: TaskInstanceKey | None, request_id: str, why: str) -> None:
        if self.driver is None or self._loop is None:
            return
        self._fencing[self._submit(self.driver.fence(request_id))] = (key, request_id, why)

    def _drain_fences(self) -> None:
        for future, (key, request_id, why) in list(self._fencing.items()):
            if not future.done():
                continue
            del self._fencing[future]
            try:
                future.result()
            except Exception:
                self.log.warning("PandaStackExecutor: fencing %s failed; retrying", request_id, exc_info=True)
                self._start_fence(key, request_id, why)
                continue
            if key is not None and key not in self._revoked:
                self.fail(key, info=f"PandaStackExecutor: {why}; its sandboxes were deleted")
            elif key is not None:
                self._forget(key)

    # -- orphans: tries that ended while no scheduler watched them -------------------------------

    def _owned_requests(self) -> set[str]:
        owned = {ref.request_id for ref in self._active.values()}
        owned |= {launch.request_id for launch in self._launching.values()}
        owned |= {finish.ref.request_id for finish in self._finishing.values()}
        owned |= {request_id for _, request_id, _ in self._fencing.values()}
        owned |= {request_id for request_id, _ in self._collecting.values()}
        return owned

    def _sweep_orphans(self) -> None:
        """Every ``orphan_sweep_interval``: delete the sandboxes of tries that have ended.

        A scheduler SIGKILLed while a try runs: if the try finishes before a new scheduler
        comes, its TI is no longer queued or running, nobody adopts it, and its sandbox
        (kept after the exit so the log can be copied) would wait for the TTL. The sweep
        lists this executor's sandboxes, looks their tries up in the metadata DB and, for a
        try that ended more than ``ORPHAN_GRACE_SECONDS`` ago, copies the task log out and
        fences its request id. A try the DB does not know as ours (another deployment
        sharing the account) is left alone: the TTL is its backstop.
        """
        list_requests = getattr(self.driver, "list_requests", None)
        if self.orphan_sweep_interval <= 0 or list_requests is None or self._loop is None:
            return
        if self._listing is None:
            if time.monotonic() >= self._next_sweep:
                self._listing = self._submit(list_requests())
            return
        if not self._listing.done():
            return
        listing, self._listing = self._listing, None
        self._next_sweep = time.monotonic() + self.orphan_sweep_interval
        try:
            owned = self._owned_requests()
            candidates = {r: labels for r, labels in listing.result().items() if r not in owned}
            ended = self._ended_tries(candidates) if candidates else {}
        except Exception:  # the next sweep tries again
            self.log.warning("PandaStackExecutor: orphan sweep failed", exc_info=True)
            return
        for request_id, ref in ended.items():
            self.log.info(
                "PandaStackExecutor: try %s ended without an owner; deleting its sandbox", request_id
            )
            self._collecting[self._submit(self._collect(request_id, ref))] = (request_id, ref)

    def _ended_tries(self, candidates: dict[str, dict[str, str]]) -> dict[str, SandboxExecutionRef | None]:
        """Of the ``candidates`` (request id -> the try's labels), the tries the metadata DB shows
        ended before the grace, with the handle their TI stored: request id -> ref.

        A try is found by its task instance key and try number, and is ours only if the row's
        ``external_executor_id`` is the request id or a ref to it.
        """
        from airflow.models.taskinstance import TaskInstance
        from airflow.models.taskinstancehistory import TaskInstanceHistory
        from airflow.utils.session import create_session
        from airflow.utils.state import State
        from sqlalchemy import select, tuple_

        wanted: dict[tuple[str, str, str, int, int], list[str]] = {}
        for request_id, labels in candidates.items():
            try:
                key = (labels["dag_id"], labels["task_id"], labels["run_id"], int(labels["map_index"]))
                wanted.setdefault((*key, int(labels["try_number"])), []).append(request_id)
            except (KeyError, ValueError):
                continue  # clipped or foreign metadata: the TTL is its backstop
        if not wanted:
            return {}
        cutoff = datetime.now(timezone.utc) - timedelta(seconds=ORPHAN_GRACE_SECONDS)
        rows: list[tuple[Any, ...]] = []
        with create_session() as session:
            for model, is_current in ((TaskInstance, True), (TaskInstanceHistory, False)):
                cols = (model.dag_id, model.task_id, model.run_id, model.map_index)
                query = select(
                    *cols, model.try_number, model.state, model.end_date, model.external_executor_id
                )
                query = query.where(tuple_(*cols).in_(sorted({k[:4] for k in wanted})))
                rows += [(*row, is_current) for row in session.execute(query).all()]
        ended: dict[str, SandboxExecutionRef | None] = {}
        for dag_id, task_id, run_id, map_index, try_number, state, end_date, external, current in rows:
            running = current and state not in State.finished
            if running or (end_date is not None and end_date >= cutoff):
                continue
            ref = SandboxExecutionRef.decode(external, expected_driver=self.driver_id)
            for found in wanted.get((dag_id, task_id, run_id, map_index, try_number), []):
                # Only the request this row names (not another deployment's try with the same names).
                if external == found or (ref is not None and ref.request_id == found):
                    ended[found] = ref
        return ended

    async def _collect(self, request_id: str, ref: SandboxExecutionRef | None) -> bytes | None:
        """An orphan's task log (when its handle was persisted), then fence its UUID."""
        assert self.driver is not None
        log = await self._read_task_log(ref) if ref is not None else None
        await self.driver.fence(request_id)
        return log

    def _drain_collects(self) -> None:
        for future, (request_id, ref) in list(self._collecting.items()):
            if not future.done():
                continue
            del self._collecting[future]
            try:
                log = future.result()
            except Exception:  # still listed: the next sweep tries again
                self.log.warning("PandaStackExecutor: deleting orphan %s failed", request_id, exc_info=True)
                continue
            if ref is not None and log is not None:
                self._write_task_log(ref.handle.data.get("log_path"), log, [])

    def _forget(self, key: TaskInstanceKey) -> None:
        self.running.discard(key)
        self._revoked.discard(key)

    # -- scheduler restart, revocation, shutdown -------------------------------------------------

    def try_adopt_task_instances(self, tis: Sequence[TaskInstance]) -> Sequence[TaskInstance]:
        """Adopt tries whose handle was persisted; fence the others before Airflow reschedules them."""
        if self._loop is None or self.driver is None:
            raise RuntimeError("PandaStackExecutor.start() must run before adoption")
        not_adopted: list[TaskInstance] = []
        for ti in tis:
            ref = SandboxExecutionRef.decode(ti.external_executor_id, expected_driver=self.driver_id)
            if ref is not None:
                try:
                    self.driver.validate_handle(ref.handle, request_id=ref.request_id)
                except ValueError as exc:
                    self.log.warning(
                        "PandaStackExecutor: %s has an unusable handle (%s); fencing", ti.key, exc
                    )
                    request_id: str | None = ref.request_id
                else:
                    self._active[ti.key] = ref
                    self._next_poll[ti.key] = 0.0
                    self.running.add(ti.key)
                    self.log.info(
                        "PandaStackExecutor: adopted %s in sandbox %s", ti.key, ref.handle.display_name
                    )
                    continue
            elif is_preassigned_executor_id(ti.external_executor_id):
                request_id = str(ti.external_executor_id)
            else:
                not_adopted.append(ti)
                continue
            assert request_id is not None
            try:
                recovered = self._loop.run(self.driver.recover(request_id), timeout=self.adoption_timeout)
            except (Exception, FutureTimeout):  # noqa: BLE001 - keep it ours until the fence holds
                self.running.add(ti.key)
                self._start_fence(ti.key, request_id, "launch interrupted by a scheduler restart")
                continue
            if recovered is None:
                not_adopted.append(ti)  # fenced: nothing of this try runs, Airflow may reschedule it
            else:
                ref = SandboxExecutionRef(self.driver_id, request_id, recovered.handle)
                self._active[ti.key] = ref
                self._next_poll[ti.key] = 0.0
                self.running.add(ti.key)
                self.running_state(ti.key, info=ref.encode())
        return not_adopted

    def revoke_task(self, *, ti: TaskInstance) -> None:
        """Stop a try without reporting a state: delete its sandbox(es)."""
        key = ti.key
        self.queued_tasks.pop(key, None)
        self._deferred.pop(key, None)
        self._next_poll.pop(key, None)
        ref = self._active.pop(key, None) or SandboxExecutionRef.decode(
            ti.external_executor_id, expected_driver=self.driver_id
        )
        request_id = ref.request_id if ref else ti.external_executor_id
        if any(launch.key == key for launch in self._launching.values()):
            self._revoked.add(key)  # the launch's end fences it
        self.running.discard(key)
        if is_preassigned_executor_id(request_id):
            self._start_fence(None, str(request_id), "revoked")

    def end(self) -> None:
        """Stop launching; running sandboxes keep going and a new scheduler adopts them."""
        deadline = time.monotonic() + self.shutdown_timeout
        while (self._launching or self._finishing) and time.monotonic() < deadline:
            self._drain_launches()
            self._drain_finishes()
            time.sleep(0.1)
        for launch in self._launching.values():
            self._start_fence(None, launch.request_id, "executor shut down during launch")
        self._wait_fences(deadline)
        self._close()

    def terminate(self) -> None:
        """Delete every sandbox this executor runs."""
        deadline = time.monotonic() + self.shutdown_timeout
        request_ids = {ref.request_id for ref in self._active.values()}
        request_ids |= {launch.request_id for launch in self._launching.values()}
        for request_id in request_ids:
            self._start_fence(None, request_id, "executor terminated")
        self._active.clear()
        self.running.clear()
        self._wait_fences(deadline)
        self._close()

    def _wait_fences(self, deadline: float) -> None:
        while self._fencing and time.monotonic() < deadline:
            self._drain_fences()
            time.sleep(0.1)

    def _close(self) -> None:
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    def get_task_log(self, ti: TaskInstance, try_number: int) -> tuple[list[str], list[str]]:
        """Live output of a running try, read from its sandbox (the task log file arrives at its end)."""
        ref = SandboxExecutionRef.decode(ti.external_executor_id, expected_driver=self.driver_id)
        if ref is None:
            return [], []
        try:
            output = asyncio.run(self.make_driver().get_output(ref.handle))
        except Exception:  # noqa: BLE001 - live output is a convenience
            return [f"could not read live output from sandbox {ref.handle.display_name}"], []
        if output is None:
            return [], []
        lines = [*output.stdout.splitlines(), *output.stderr.splitlines()]
        return [f"live output from sandbox {ref.handle.display_name}"], lines
