"""The engine: a provider-neutral sandbox executor's loop and state machine.

The shape of Airflow's ``common.sandbox`` ``BaseSandboxExecutor``: the scheduler hands over an
``ExecuteTask``; the engine builds a :class:`SandboxLaunchRequest` (the concrete executor's
``build_launch_config`` plus the Task SDK workload command), launches it through a
:class:`~airflow_provider.executors.contract.SandboxDriver` on its own asyncio loop, persists
the :class:`SandboxExecutionRef` in ``external_executor_id``, polls, and reports the end.

A try moves launch -> poll -> finish (collect, then terminate) -> success / failed, or is fenced:
every sandbox of its request id deleted before Airflow may start another try. A launch that
failed and whose fence failed too is a :class:`SandboxLaunchUnfencedError`: the try stays
running until a fence holds, then fails with the launch's error. A failing fence is retried
with exponential backoff (``poll_interval * 2**attempts``, capped at ``MAX_POLL_INTERVAL``,
with jitter), as ``common.sandbox`` retries its fences, never once per heartbeat.

Concrete executors provide ``make_driver`` and ``build_launch_config`` and may override the
hooks (``handle_data``, ``collect_end``, ``report_end``, ``report_not_started``, ``sweep``,
``owned_requests``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from airflow.executors.base_executor import BaseExecutor, get_execution_api_server_url
from airflow.executors.workloads import ExecuteTask

from .contract import (
    SandboxConfigurationError,
    SandboxDriver,
    SandboxInvalidHandleError,
    SandboxLaunchUnfencedError,
)
from .models import (
    SandboxCapacityError,
    SandboxExecutionRef,
    SandboxHandle,
    SandboxLaunchConfig,
    SandboxLaunchRequest,
    SandboxResult,
    SandboxState,
    is_preassigned_executor_id,
)
from .options import config_error, read_section, unknown_options

if TYPE_CHECKING:
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.taskinstancekey import TaskInstanceKey

T = TypeVar("T")

WORKLOAD_MODULE = "airflow.sdk.execution_time.execute_workload"
MAX_POLL_INTERVAL = 30.0


def backoff(base: float, attempts: int, cap: float = MAX_POLL_INTERVAL) -> float:
    """Seconds to wait after ``attempts`` failures: ``base * 2**attempts``, capped, plus jitter."""
    interval = min(base * 2 ** min(attempts, 8), cap)
    return interval + random.uniform(0, min(interval / 5, 1.0))  # noqa: S311 - jitter, not crypto


class DriverLoop(Protocol):
    """Where the driver's coroutines run; the scheduler thread gets futures (never blocks on one,
    but for ``run``)."""

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]: ...

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T: ...

    def close(self, driver: SandboxDriver | None = None) -> None: ...


class _Loop:
    """An asyncio loop on a daemon thread: driver coroutines run there, the scheduler gets futures.

    Concurrency toward the API is bounded by one semaphore, so a burst of queued tasks
    cannot open hundreds of connections at once.
    """

    def __init__(self, concurrency: int) -> None:
        self._loop = asyncio.new_event_loop()
        self._limit = asyncio.Semaphore(concurrency)
        self._thread = threading.Thread(target=self._loop.run_forever, name="sandbox-executor", daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        async def bounded() -> T:
            async with self._limit:
                return await coro

        return asyncio.run_coroutine_threadsafe(bounded(), self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        return self.submit(coro).result(timeout=timeout)

    def close(self, driver: SandboxDriver | None = None) -> None:
        if driver is not None:
            with contextlib.suppress(Exception, FutureTimeout):
                asyncio.run_coroutine_threadsafe(driver.close(), self._loop).result(timeout=10)
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


@dataclass
class _Fence:
    """One request id to fence until it holds; then the try it holds back (``key``) is reported."""

    request_id: str
    why: str
    key: TaskInstanceKey | None = None
    failure_info: str | None = None
    requeue: tuple[float, ExecuteTask] | None = None
    """A capacity refusal whose fence failed: queued again (at this due time) once the fence holds."""
    attempts: int = 0
    next_attempt: float = 0.0
    future: Future[None] | None = None


class SandboxExecutorEngine(BaseExecutor):
    """Each task try in its own throwaway sandbox, through one :class:`SandboxDriver`."""

    is_local = False
    is_production = True
    serve_logs = False
    supports_ad_hoc_ti_run = False
    pre_assigns_external_executor_id: ClassVar[bool] = True
    driver_id: ClassVar[str]
    config_section: ClassVar[str]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        values, problems = self.read_options()
        if problems:
            raise SandboxConfigurationError(config_error(self.config_section, problems))
        self.options: dict[str, Any] = values
        """Every option of the section, read and checked (options.py declares them)."""
        self.poll_interval: float = values["poll_interval"]
        self.launch_concurrency: int = values["launch_concurrency"]
        self.adoption_timeout: float = values["adoption_timeout"]
        self.shutdown_timeout: float = values["shutdown_timeout"]
        self.check_health: bool = values["check_health_on_startup"]
        self.driver: SandboxDriver | None = None
        self.clock: Callable[[], float] = time.monotonic
        """When things are due (polls, requeues, fence retries): a test sets its own to skip waits."""
        self.sleep: Callable[[float], None] = time.sleep
        """The pause of the shutdown's waits (on ``clock``)."""
        self.make_loop: Callable[[int], DriverLoop] = _Loop
        """The loop driver calls run on (``concurrency``): a test's settles each call at once."""
        self._loop: DriverLoop | None = None
        self._launching: dict[Future[SandboxExecutionRef], _Launch] = {}
        self._polling: dict[Future[SandboxResult], tuple[TaskInstanceKey, SandboxExecutionRef]] = {}
        self._finishing: dict[Future[Any], _Finish] = {}
        self._fences: dict[str, _Fence] = {}
        self._active: dict[TaskInstanceKey, SandboxExecutionRef] = {}
        self._next_poll: dict[TaskInstanceKey, float] = {}
        self._poll_failures: dict[TaskInstanceKey, int] = {}
        self._deferred: dict[TaskInstanceKey, tuple[float, ExecuteTask]] = {}
        self._revoked: set[TaskInstanceKey] = set()

    @property
    def label(self) -> str:
        """This executor's class name, for messages (``BaseExecutor.name`` is Airflow's own)."""
        return type(self).__name__

    def read_options(self) -> tuple[dict[str, Any], list[str]]:
        """Every option of the section and one problem per bad one, all read before any is used, so
        the error names each (a subclass adds what it reads, e.g. the launch defaults)."""
        values, problems = read_section(self.conf.get, self.config_section)
        try:
            present = self.conf.getsection(self.config_section)
        except Exception:  # noqa: BLE001 - a conf without the section lists nothing unknown
            present = None
        return values, problems + unknown_options(present, self.config_section)

    # -- what a concrete executor provides ---------------------------------------------------------

    def make_driver(self) -> SandboxDriver:
        """The driver, with credentials resolved here, in the scheduler."""
        raise NotImplementedError

    def build_launch_config(self, workload: ExecuteTask) -> SandboxLaunchConfig:
        """Validate the task's options and prepare its launch (raise ``SandboxConfigurationError``)."""
        raise NotImplementedError

    def workload_command(self, workload: ExecuteTask) -> list[str]:
        """Airflow's standard Task SDK workload command, as Kubernetes and sandbox executors run it."""
        return ["python", "-m", WORKLOAD_MODULE, "--json-string", workload.model_dump_json()]

    def runtime_env(self, task_env: dict[str, str]) -> dict[str, str]:
        """The sandbox's environment: the task's env plus the Airflow runtime variables."""
        env = dict(task_env)
        env["AIRFLOW_IS_EXECUTOR_CONTAINER"] = "true"
        env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] = get_execution_api_server_url(self.conf)
        return env

    def missing_request_id(self, ti: Any) -> str:
        """The error for a try without a pre-assigned UUID."""
        return (
            f"task {ti.key} has no pre-assigned external_executor_id; sandbox executors need Airflow >= 3.3"
        )

    def handle_data(self, workload: ExecuteTask) -> dict[str, Any]:
        """Extra data persisted with the try's handle (the task log's path, for one)."""
        return {}

    async def collect_end(self, ref: SandboxExecutionRef, result: SandboxResult) -> Any:
        """What to bring back from an ended try's sandbox before it is deleted."""
        return None

    def report_end(self, ref: SandboxExecutionRef, result: SandboxResult, collected: Any) -> str | None:
        """Record an ended try (its log); the failure info for a try that did not succeed."""
        return result.message

    def report_not_started(self, workload: ExecuteTask, message: str) -> None:
        """Record why a try never ran (a bad option, a failed launch)."""

    def sweep(self) -> None:
        """An extra step each heartbeat (PandaStack: the orphan sweep)."""

    def owned_requests(self) -> set[str]:
        """Every request id this executor is handling now (a sweep must leave them alone)."""
        owned = {ref.request_id for ref in self._active.values()}
        owned |= {launch.request_id for launch in self._launching.values()}
        owned |= {finish.ref.request_id for finish in self._finishing.values()}
        owned |= set(self._fences)
        return owned

    # -- start -------------------------------------------------------------------------------------

    def start(self) -> None:
        driver = self.make_driver()
        if driver.driver_id != self.driver_id:
            raise SandboxConfigurationError(
                f"driver id {driver.driver_id!r} does not match the executor's {self.driver_id!r}"
            )
        self.driver, self._loop = driver, self.make_loop(self.launch_concurrency)
        if self.check_health:
            try:
                self._loop.run(driver.health_check(), timeout=30)
            except Exception:
                self._loop.close()
                self._loop = None
                raise

    def _submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        if self._loop is None:
            coro.close()
            raise RuntimeError(f"{self.label}.start() must run before tasks are queued")
        return self._loop.submit(coro)

    # -- queue -> launch ---------------------------------------------------------------------------

    def launch_request(self, workload: ExecuteTask) -> SandboxLaunchRequest:
        """The try's launch request (raises a clear ``SandboxConfigurationError``)."""
        ti = workload.ti
        if not is_preassigned_executor_id(ti.external_executor_id):
            raise SandboxConfigurationError(self.missing_request_id(ti))
        config = self.build_launch_config(workload)
        return SandboxLaunchRequest(
            request_id=str(ti.external_executor_id),
            command=tuple(self.workload_command(workload)),
            env=self.runtime_env(dict(config.env)),
            provider_config=config.provider_config,
            workdir=config.workdir,
            timeout_seconds=config.timeout_seconds,
            ttl_seconds=config.ttl_seconds,
            keep=config.keep,
        )

    async def _launch(self, request: SandboxLaunchRequest, extra: dict[str, Any]) -> SandboxExecutionRef:
        """Launch; on any error fence the request (a create may have gone through) and re-raise,
        or raise :class:`SandboxLaunchUnfencedError` when the fence fails too."""
        assert self.driver is not None
        try:
            handle = await self.driver.launch(request)
            self.driver.validate_handle(handle, request_id=request.request_id)
            handle = SandboxHandle({**handle.data, **extra}, display_name=handle.display_name)
            ref = SandboxExecutionRef(self.driver_id, request.request_id, handle)
            ref.encode()  # too large to persist: fail now, while the fence can still run
        except BaseException as launch_error:
            try:
                await self.driver.fence(request.request_id)
            except BaseException as fence_error:  # noqa: BLE001 - wrapped: the try is held until a fence holds
                raise SandboxLaunchUnfencedError(
                    request.request_id, launch_error, fence_error
                ) from launch_error
            raise
        return ref

    def _process_workloads(self, workload_items: Sequence[Any]) -> None:
        for workload in workload_items:
            if not isinstance(workload, ExecuteTask):
                raise RuntimeError(f"{self.label} runs task workloads only, not {type(workload)}")
            key = workload.ti.key
            self.queued_tasks.pop(key, None)
            self.running.add(key)
            try:
                request = self.launch_request(workload)
            except (SandboxConfigurationError, ValueError) as exc:
                self.log.error("%s: cannot run %s: %s", self.label, key, exc)
                self.report_not_started(workload, f"{self.label}: task not started: {exc}")
                self.fail(key, info=str(exc))
                continue
            future = self._submit(self._launch(request, self.handle_data(workload)))
            self._launching[future] = _Launch(key, request.request_id, workload)

    # -- the heartbeat -----------------------------------------------------------------------------

    def sync(self) -> None:
        self._drain_launches()
        self._drain_polls()
        self._drain_finishes()
        self._drain_fences()
        self._requeue_due()
        self._schedule_fences()
        self._schedule_polls()
        self.sweep()

    def _drain_launches(self) -> None:
        for future, launch in list(self._launching.items()):
            if not future.done():
                continue
            del self._launching[future]
            key = launch.key
            try:
                ref = future.result()
            except SandboxLaunchUnfencedError as exc:
                self._unfenced(launch, exc)
                continue
            except SandboxCapacityError as exc:
                self.log.info("refused %s for capacity; queued again in %.1fs", key, exc.retry_after)
                self._deferred[key] = (self.clock() + exc.retry_after, launch.workload)
                continue
            except Exception as exc:  # noqa: BLE001 - any launch error fails the try; retries apply
                self.log.error("%s: launch of %s failed: %s", self.label, key, exc)
                self.report_not_started(launch.workload, f"{self.label}: {exc}")
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

    def _unfenced(self, launch: _Launch, exc: SandboxLaunchUnfencedError) -> None:
        """A failed launch that may have left a sandbox: hold the try until a fence holds."""
        error = exc.launch_error
        self.log.error(
            "%s: launch of %s failed (%s) and its sandbox could not be deleted (%s); "
            "fencing request %s before the try ends",
            self.label,
            launch.key,
            error,
            exc.fence_error,
            exc.request_id,
        )
        if isinstance(error, SandboxCapacityError):
            due = (self.clock() + error.retry_after, launch.workload)
            self._start_fence(launch.key, exc.request_id, "capacity refusal", requeue=due)
            return
        self.report_not_started(launch.workload, f"{self.label}: {error}")
        self._start_fence(launch.key, exc.request_id, "launch failed", failure_info=str(error))

    def _requeue_due(self) -> None:
        now = self.clock()
        for key, (due, workload) in list(self._deferred.items()):
            if due <= now:
                del self._deferred[key]
                self.running.discard(key)
                self.queued_tasks[key] = workload

    def _schedule_polls(self) -> None:
        if self._loop is None or self.driver is None:
            return
        now = self.clock()
        busy = {key for key, _ in self._polling.values()}
        for key, ref in list(self._active.items()):
            if key in busy or self._next_poll.get(key, 0.0) > now:
                continue
            self._polling[self._submit(self.driver.get_status(ref.handle))] = (key, ref)

    def _defer_poll(self, key: TaskInstanceKey, failed: bool, retry_after: float | None = None) -> None:
        failures = self._poll_failures.get(key, 0) + 1 if failed else 0
        self._poll_failures[key] = failures
        if retry_after is not None:
            interval = min(retry_after, MAX_POLL_INTERVAL)
        else:
            interval = min(self.poll_interval * (2 ** min(failures, 8)), MAX_POLL_INTERVAL)
        self._next_poll[key] = self.clock() + interval + random.uniform(0, interval / 10)  # noqa: S311

    def _drain_polls(self) -> None:
        for future, (key, ref) in list(self._polling.items()):
            if not future.done():
                continue
            del self._polling[future]
            if self._active.get(key) != ref:
                continue
            try:
                result = future.result()
            except SandboxInvalidHandleError as exc:
                self._drop(key)
                self._start_fence(key, ref.request_id, "invalid handle", failure_info=str(exc))
                continue
            except Exception:
                self.log.warning("%s: status of %s failed; polling again", self.label, key, exc_info=True)
                self._defer_poll(key, failed=True)
                continue
            if not result.terminal:
                self._defer_poll(key, failed=False, retry_after=result.retry_after)
                continue
            self._drop(key)
            self._finishing[self._submit(self._finish(ref, result))] = _Finish(key, ref, result)

    def _drop(self, key: TaskInstanceKey) -> None:
        del self._active[key]
        self._next_poll.pop(key, None)
        self._poll_failures.pop(key, None)

    async def _finish(self, ref: SandboxExecutionRef, result: SandboxResult) -> Any:
        """Bring back what the executor keeps of the try, then delete the sandbox."""
        assert self.driver is not None
        collected = await self.collect_end(ref, result)
        await self.driver.terminate(ref.handle)
        return collected

    def _drain_finishes(self) -> None:
        for future, finish in list(self._finishing.items()):
            if not future.done():
                continue
            del self._finishing[future]
            key, ref, result = finish.key, finish.ref, finish.result
            collected: Any = None
            try:
                collected = future.result()
            except Exception:
                self.log.warning("%s: cleanup of %s failed; fencing", self.label, key, exc_info=True)
                self._start_fence(None, ref.request_id, "cleanup")
            info = self.report_end(ref, result, collected)
            if key in self._revoked:
                self._forget(key)
            elif result.state is SandboxState.SUCCEEDED:
                self.success(key)
            else:
                self.fail(key, info=info or result.message)

    # -- fencing -----------------------------------------------------------------------------------

    def _start_fence(
        self,
        key: TaskInstanceKey | None,
        request_id: str,
        why: str,
        *,
        failure_info: str | None = None,
        requeue: tuple[float, ExecuteTask] | None = None,
    ) -> None:
        """Fence ``request_id`` until it holds; a ``key`` is reported (failed or requeued) then."""
        if self.driver is None or self._loop is None:
            return
        fence = self._fences.get(request_id)
        if fence is None:
            self._fences[request_id] = _Fence(request_id, why, key, failure_info, requeue)
        elif key is not None and fence.key is None:
            fence.key, fence.why, fence.failure_info, fence.requeue = key, why, failure_info, requeue
        self._schedule_fences()

    def _schedule_fences(self) -> None:
        """Submit every fence that is due and not in flight (a failed one waits out its backoff)."""
        if self.driver is None or self._loop is None:
            return
        now = self.clock()
        for fence in self._fences.values():
            if fence.future is None and fence.next_attempt <= now:
                fence.future = self._submit(self.driver.fence(fence.request_id))

    def _drain_fences(self) -> None:
        for request_id, fence in list(self._fences.items()):
            if fence.future is None or not fence.future.done():
                continue
            future, fence.future = fence.future, None
            try:
                future.result()
            except Exception as exc:  # noqa: BLE001 - any failure: retried after the backoff
                fence.attempts += 1
                delay = backoff(self.poll_interval, fence.attempts)
                fence.next_attempt = self.clock() + delay
                self.log.warning(
                    "%s: fencing %s failed (attempt %d: %s); retrying in %.1fs",
                    self.label,
                    request_id,
                    fence.attempts,
                    exc,
                    delay,
                )
                continue
            del self._fences[request_id]
            key = fence.key
            if key is None:
                continue
            if key in self._revoked:
                self._forget(key)
            elif fence.requeue is not None:
                self._deferred[key] = fence.requeue
            else:
                info = fence.failure_info or f"{self.label}: {fence.why}; its sandboxes were deleted"
                self.fail(key, info=info)

    def _forget(self, key: TaskInstanceKey) -> None:
        self.running.discard(key)
        self._revoked.discard(key)

    # -- scheduler restart, revocation, shutdown ---------------------------------------------------

    def try_adopt_task_instances(self, tis: Sequence[TaskInstance]) -> Sequence[TaskInstance]:
        """Adopt tries whose handle was persisted; fence the others before Airflow reschedules them."""
        if self._loop is None or self.driver is None:
            raise RuntimeError(f"{self.label}.start() must run before adoption")
        not_adopted: list[TaskInstance] = []
        for ti in tis:
            ref = SandboxExecutionRef.decode(ti.external_executor_id, expected_driver=self.driver_id)
            if ref is not None:
                try:
                    self.driver.validate_handle(ref.handle, request_id=ref.request_id)
                except (SandboxInvalidHandleError, ValueError) as exc:
                    self.log.warning("%s: %s has an unusable handle (%s); fencing", self.label, ti.key, exc)
                    request_id: str | None = ref.request_id
                else:
                    self._adopt(ti.key, ref)
                    self.log.info("%s: adopted %s in sandbox %s", self.label, ti.key, ref.handle.display_name)
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
                ref = SandboxExecutionRef(self.driver_id, request_id, recovered.handle, keep=recovered.keep)
                self._adopt(ti.key, ref)
                self.running_state(ti.key, info=ref.encode())
        return not_adopted

    def _adopt(self, key: TaskInstanceKey, ref: SandboxExecutionRef) -> None:
        self._active[key] = ref
        self._next_poll[key] = 0.0
        self.running.add(key)

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
        if any(launch.key == key for launch in self._launching.values()) or any(
            fence.key == key for fence in self._fences.values()
        ):
            self._revoked.add(key)  # the launch's end (or the fence holding it) forgets it
        self.running.discard(key)
        if is_preassigned_executor_id(request_id):
            self._start_fence(None, str(request_id), "revoked")

    def end(self) -> None:
        """Stop launching; running sandboxes keep going and a new scheduler adopts them."""
        deadline = self.clock() + self.shutdown_timeout
        while (self._launching or self._finishing) and self.clock() < deadline:
            self._drain_launches()
            self._drain_finishes()
            self.sleep(0.1)
        for launch in self._launching.values():
            self._start_fence(None, launch.request_id, "executor shut down during launch")
        self._wait_fences(deadline)
        self._close()

    def terminate(self) -> None:
        """Delete every sandbox this executor runs."""
        deadline = self.clock() + self.shutdown_timeout
        request_ids = {ref.request_id for ref in self._active.values()}
        request_ids |= {launch.request_id for launch in self._launching.values()}
        for request_id in request_ids:
            self._start_fence(None, request_id, "executor terminated")
        self._active.clear()
        self.running.clear()
        self._wait_fences(deadline)
        self._close()

    def _wait_fences(self, deadline: float) -> None:
        while self._fences and self.clock() < deadline:
            self._drain_fences()
            self._schedule_fences()
            self.sleep(0.05)
        if self._fences:
            self.log.warning(
                "%s: %d fence(s) did not hold before shutdown; the sandboxes' TTL is their backstop",
                self.label,
                len(self._fences),
            )

    def _close(self) -> None:
        if self._loop is not None:
            self._loop.close(self.driver)
            self._loop = None

    def get_task_log(self, ti: TaskInstance, try_number: int) -> tuple[list[str], list[str]]:
        """Live output of a running try, read from its sandbox."""
        ref = SandboxExecutionRef.decode(ti.external_executor_id, expected_driver=self.driver_id)
        if ref is None:
            return [], []

        async def fetch() -> Any:
            driver = self.make_driver()
            try:
                return await driver.get_output(ref.handle)
            finally:
                await driver.close()

        try:
            output = asyncio.run(fetch())
        except Exception:  # noqa: BLE001 - live output is a convenience
            return [f"could not read live output from sandbox {ref.handle.display_name}"], []
        if output is None:
            return [], []
        lines = [*output.stdout.splitlines(), *output.stderr.splitlines()]
        return [f"live output from sandbox {ref.handle.display_name}"], lines
