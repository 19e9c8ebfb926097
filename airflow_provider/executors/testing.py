"""An in-memory :class:`~airflow_provider.executors.driver.SandboxDriver` for the executor's unit tests.

``common.sandbox`` drives its executor through a fake manager; this is that seam here.
:class:`FakeSandboxDriver` keeps one "sandbox" per request id, answers ``get_status`` from
a scripted sequence of :class:`SandboxResult` s, and records every call, so a test can walk
``PandaStackExecutor`` through launch → poll → finish → fence, adoption, revocation, capacity
requeues and the orphan sweep in milliseconds, with no server and no sandbox.

It fulfils the contract the executor uses: the abstract methods, ``recover`` and
``get_output``, and the two PandaStack extensions the executor looks up with ``getattr``
(``read_file`` for the task log, ``list_requests`` for the orphan sweep).

    driver = FakeSandboxDriver()
    driver.plan(request_id, [SandboxResult(SandboxState.RUNNING), SandboxResult(SandboxState.SUCCEEDED, 0)])
    executor.make_driver = lambda: driver
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from . import models
from .contract import SandboxDriver
from .models import SandboxHandle, SandboxLaunchRequest, SandboxOutput, SandboxResult, SandboxState

OPERATIONS = (
    "health_check",
    "launch",
    "get_status",
    "terminate",
    "fence",
    "recover",
    "get_output",
    "read_file",
    "list_requests",
)
SUCCEEDED = SandboxResult(SandboxState.SUCCEEDED, exit_code=0)
T = TypeVar("T")


class FakeClock:
    """A clock that moves only when told: ``executor.clock = executor.sleep = ...`` (a sleep advances
    it), so waits are skipped and a delay is a number the test can assert exactly."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += max(seconds, 0.0)

    def advance_to(self, when: float) -> None:
        self.now = max(self.now, when)


class SettledLoop:
    """The engine's driver loop for unit tests (``executor.make_loop = SettledLoop``): each call runs
    to its end when submitted, in the caller's thread, and comes back as a settled future, so one
    heartbeat's outcome is fixed by what the test scripted, never by a thread's timing."""

    def __init__(self, concurrency: int = 1) -> None:
        self._loop = asyncio.new_event_loop()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        future: Future[T] = Future()
        try:
            future.set_result(self._loop.run_until_complete(coro))
        except BaseException as exc:  # noqa: BLE001 - the future carries it, as the real loop's does
            future.set_exception(exc)
        return future

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        return self.submit(coro).result(timeout=0)

    def close(self, driver: SandboxDriver | None = None) -> None:
        if driver is not None:
            self.submit(driver.close())
        self._loop.close()


@dataclass
class Plan:
    """What the sandbox of one request does (see :meth:`FakeSandboxDriver.plan`)."""

    statuses: list[SandboxResult] = field(default_factory=lambda: [SUCCEEDED])
    """Answers of successive ``get_status`` calls; the last one repeats."""
    output: SandboxOutput | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    launch_error: BaseException | None = None
    recoverable: bool = False
    """``recover`` rebuilds a handle (instead of fencing) when the sandbox is live."""


class FakeSandboxDriver(SandboxDriver):
    """A driver whose sandboxes are dict entries; ``live`` holds the request ids with a sandbox."""

    driver_id: ClassVar[str] = "pandastack"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.plans: dict[str, Plan] = {}
        self.default = Plan()
        self.live: dict[str, SandboxHandle] = {}
        self.labels: dict[str, dict[str, str]] = {}
        self.launched: list[SandboxLaunchRequest] = []
        self.calls: list[tuple[str, str]] = []
        self.call_times: list[float] = []
        """``clock()`` of each entry of ``calls``."""
        self.clock: Callable[[], float] = time.monotonic
        self._polls: dict[str, int] = {}
        self._failures: list[tuple[str, BaseException, int | None]] = []
        self.closed = False

    # -- scripting ---------------------------------------------------------------------------

    def plan(
        self,
        request_id: str | None,
        statuses: Sequence[SandboxResult] = (SUCCEEDED,),
        **fields: object,
    ) -> Plan:
        """Script one request's sandbox (``request_id=None``: every request without a plan)."""
        chosen = Plan(statuses=list(statuses), **fields)  # type: ignore[arg-type]
        with self._lock:
            if request_id is None:
                self.default = chosen
            else:
                self.plans[request_id] = chosen
        return chosen

    def fail(self, op: str, error: BaseException, *, times: int | None = 1) -> None:
        """Make the next ``times`` (None: every) calls of ``op`` raise ``error``."""
        if op not in OPERATIONS:
            raise ValueError(f"op: {op!r} is not one of {', '.join(OPERATIONS)}")
        with self._lock:
            self._failures.append((op, error, times))

    def add_live(self, request_id: str, labels: dict[str, str] | None = None) -> SandboxHandle:
        """A sandbox launched by an earlier scheduler (for adoption and the orphan sweep)."""
        handle = SandboxHandle({"request_id": request_id}, display_name=f"sb-{request_id[:8]}")
        with self._lock:
            self.live[request_id] = handle
            self.labels[request_id] = dict(labels or {})
        return handle

    # -- the contract ------------------------------------------------------------------------

    def _enter(self, op: str, request_id: str = "") -> None:
        with self._lock:
            self.calls.append((op, request_id))
            self.call_times.append(self.clock())
            for i, (name, error, times) in enumerate(self._failures):
                if name != op:
                    continue
                if times is not None:
                    if times <= 1:
                        del self._failures[i]
                    else:
                        self._failures[i] = (name, error, times - 1)
                raise error

    def _plan(self, request_id: str) -> Plan:
        return self.plans.get(request_id, self.default)

    @staticmethod
    def _request_id(handle: SandboxHandle) -> str:
        return str(handle.data["request_id"])

    async def health_check(self) -> None:
        self._enter("health_check")

    async def launch(self, request: SandboxLaunchRequest) -> SandboxHandle:
        self._enter("launch", request.request_id)
        plan = self._plan(request.request_id)
        with self._lock:
            self.launched.append(request)
            handle = SandboxHandle(
                {"request_id": request.request_id}, display_name=f"sb-{request.request_id[:8]}"
            )
            self.live[request.request_id] = handle  # created, even when the start then fails
            self.labels[request.request_id] = dict(request.provider_config.get("labels") or {})
        if plan.launch_error is not None:
            raise plan.launch_error
        return handle

    def validate_handle(self, handle: SandboxHandle, *, request_id: str) -> None:
        if handle.data.get("request_id") != request_id:
            raise models.SandboxInvalidHandleError(
                f"handle {dict(handle.data)} is not of request {request_id}"
            )

    async def get_status(self, handle: SandboxHandle) -> SandboxResult:
        request_id = self._request_id(handle)
        self._enter("get_status", request_id)
        with self._lock:
            if request_id not in self.live:
                return SandboxResult(SandboxState.GONE, message="sandbox lost: not found")
            statuses = self._plan(request_id).statuses
            n = self._polls.get(request_id, 0)
            self._polls[request_id] = n + 1
        return statuses[min(n, len(statuses) - 1)]

    async def terminate(self, handle: SandboxHandle) -> None:
        request_id = self._request_id(handle)
        self._enter("terminate", request_id)
        with self._lock:
            self.live.pop(request_id, None)

    async def fence(self, request_id: str) -> None:
        self._enter("fence", request_id)
        with self._lock:
            self.live.pop(request_id, None)

    async def recover(self, request_id: str) -> models.RecoveredSandbox | None:
        self._enter("recover", request_id)
        with self._lock:
            handle = self.live.get(request_id)
        if handle is not None and self._plan(request_id).recoverable:
            return models.RecoveredSandbox(handle)
        await self.fence(request_id)
        return None

    async def get_output(self, handle: SandboxHandle) -> SandboxOutput | None:
        request_id = self._request_id(handle)
        self._enter("get_output", request_id)
        return self._plan(request_id).output if request_id in self.live else None

    async def read_file(self, handle: SandboxHandle, path: str, limit: int) -> bytes | None:
        """The PandaStack extension: the last ``limit`` bytes of a file in the sandbox."""
        request_id = self._request_id(handle)
        self._enter("read_file", request_id)
        data = self._plan(request_id).files.get(path) if request_id in self.live else None
        return None if data is None else data[-limit:]

    async def list_requests(self) -> dict[str, dict[str, str]]:
        """The PandaStack extension: live request ids and their try's labels."""
        self._enter("list_requests")
        with self._lock:
            return {rid: dict(self.labels.get(rid, {})) for rid in self.live}

    async def close(self) -> None:
        self.closed = True
