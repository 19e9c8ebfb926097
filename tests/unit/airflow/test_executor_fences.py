"""Fencing in ``PandaStackExecutor``'s engine, through :class:`FakeSandboxDriver`: a failing fence
backs off (``common.sandbox``'s retry, not one call per heartbeat), and a launch that failed
and could not be fenced holds its try until a fence holds (``SandboxLaunchUnfencedError``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from airflow_provider.executors.models import SandboxCapacityError, SandboxResult, SandboxState
from airflow_provider.executors.testing import FakeSandboxDriver
from tests.unit.airflow.executor_support import (
    beat_until,
    final_event,
    running_try,
    skip_waits,
    workload,
)

POLL = 0.02  # the backoff's base: fences wait 2, 4, 8 x this after 1, 2, 3 failures


@pytest.fixture
def slow_executor(make_executor: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__POLL_INTERVAL", str(POLL))
    return make_executor(parallelism=4)


def fence_times(driver: FakeSandboxDriver, rid: str) -> list[float]:
    return [t for call, t in zip(driver.calls, driver.call_times, strict=True) if call == ("fence", rid)]


def test_a_failing_fence_backs_off_instead_of_retrying_every_heartbeat(
    slow_executor: Any, driver: FakeSandboxDriver
) -> None:
    wl = running_try(slow_executor, driver)
    rid = wl.ti.external_executor_id
    driver.fail("fence", RuntimeError("api down"), times=3)
    slow_executor.revoke_task(ti=wl.ti)
    beat_until(slow_executor, lambda: rid not in driver.live)
    times = fence_times(driver, rid)  # on the fake clock: each gap is the backoff the engine chose
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(times) == 4, times  # three failures, then the one that held: not one per heartbeat
    # base * 2**attempts, plus up to a fifth of it as jitter
    assert all(POLL * 2 ** (i + 1) <= gap <= POLL * 2 ** (i + 1) * 1.2 for i, gap in enumerate(gaps)), gaps


def test_an_unfenced_launch_holds_the_try_until_a_fence_holds_then_fails_it(
    executor: Any, driver: FakeSandboxDriver
) -> None:
    """The create went through, the start failed, and the first two fences fail: Airflow must not
    hear "failed" (and start the next try) while that sandbox may still run."""
    wl = workload()
    rid, key = wl.ti.external_executor_id, wl.ti.key
    driver.plan(rid, launch_error=RuntimeError("sandbox launch failed (server_error): boom"))
    driver.fail("fence", RuntimeError("api down"), times=2)
    executor.queue_workload(wl, session=None)
    for _ in range(200):
        if str(executor.event_buffer.get(key, ("",))[0]) == "failed":
            break
        assert key in executor.running or key in executor.queued_tasks
        executor.heartbeat()
        skip_waits(executor)
    assert str(executor.event_buffer.get(key, ("",))[0]) == "failed", "the try never failed"
    assert rid not in driver.live, "the try was failed while its sandbox was still there"
    assert "boom" in executor.event_buffer[key][1]  # the launch's error, not the fence's
    assert driver.calls.count(("fence", rid)) == 3


def test_an_unfenced_capacity_refusal_is_requeued_once_the_fence_holds(
    executor: Any, driver: FakeSandboxDriver
) -> None:
    wl = workload()
    rid, key = wl.ti.external_executor_id, wl.ti.key
    driver.plan(rid, launch_error=SandboxCapacityError("no compute capacity available", retry_after=0.3))
    driver.fail("fence", RuntimeError("api down"), times=1)
    executor.queue_workload(wl, session=None)
    beat_until(executor, lambda: key in executor._deferred)
    assert rid not in driver.live and key not in executor.event_buffer  # fenced first, not failed
    driver.plan(rid, [SandboxResult(SandboxState.SUCCEEDED, 0)])
    assert final_event(executor, key)[0] == "success"
    assert [op for op, r in driver.calls if r == rid].count("launch") == 2


def test_a_status_call_that_finds_the_handle_invalid_fences_and_fails_the_try(
    executor: Any, driver: FakeSandboxDriver
) -> None:
    from airflow_provider.executors.models import SandboxInvalidHandleError

    driver.fail("get_status", SandboxInvalidHandleError("handle of another schema"))
    wl = workload()
    rid = wl.ti.external_executor_id
    executor.queue_workload(wl, session=None)
    state, info = final_event(executor, wl.ti.key)
    assert state == "failed" and "another schema" in info
    assert ("fence", rid) in driver.calls and rid not in driver.live


def test_a_handle_too_large_to_persist_is_fenced_before_the_try_fails(
    executor: Any, driver: FakeSandboxDriver
) -> None:
    wl = workload()
    wl = wl.model_copy(update={"log_path": "x/" * 3000 + "1.log"})  # persisted with the handle
    rid = wl.ti.external_executor_id
    executor.queue_workload(wl, session=None)
    state, info = final_event(executor, wl.ti.key)
    assert state == "failed" and "too large" in info
    assert driver.calls[-1] == ("fence", rid) and rid not in driver.live


def test_a_driver_with_another_id_is_refused_at_start(logs: Path) -> None:
    from airflow_provider.executors import PandaStackExecutor
    from airflow_provider.executors.models import SandboxConfigurationError

    class Other(FakeSandboxDriver):
        driver_id = "islo"

    ex = PandaStackExecutor(parallelism=1)
    ex.make_driver = Other  # type: ignore[method-assign,assignment]
    with pytest.raises(SandboxConfigurationError, match="'islo' does not match"):
        ex.start()
