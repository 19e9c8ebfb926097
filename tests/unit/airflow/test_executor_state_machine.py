"""``PandaStackExecutor``'s state machine through :class:`FakeSandboxDriver`: what the scheduler
sees (events, running set, task log) for each path a try can take, in milliseconds.

The same paths against real sandboxes are in tests/airflow/test_airflow_executor*.py.
"""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path
from typing import Any

import pytest

from airflow_provider.executors.models import (
    SandboxCapacityError,
    SandboxExecutionRef,
    SandboxOutput,
    SandboxResult,
    SandboxState,
)
from airflow_provider.executors.testing import FakeSandboxDriver
from tests.unit.airflow.executor_support import (
    FAILED_3,
    RUNNING,
    beat_until,
    final_event,
    log_events,
    running_try,
    settled,
    workload,
)


def test_a_try_runs_is_persisted_polled_and_succeeds_and_its_sandbox_is_deleted(
    executor: Any, driver: FakeSandboxDriver, logs: Path
) -> None:
    wl = workload()
    rid = wl.ti.external_executor_id
    task_log = b"task said hello\n"
    driver.plan(
        rid,
        [RUNNING, RUNNING, SandboxResult(SandboxState.SUCCEEDED, 0)],
        files={f"/work/logs/{wl.log_path}": task_log},
    )
    executor.queue_workload(wl, session=None)
    beat_until(executor, lambda: str(executor.event_buffer.get(wl.ti.key, ("",))[0]) == "running")
    ref = SandboxExecutionRef.decode(executor.event_buffer[wl.ti.key][1], expected_driver="pandastack")
    assert ref is not None and ref.request_id == rid and ref.handle.data["log_path"] == wl.log_path
    executor.event_buffer.clear()
    assert final_event(executor, wl.ti.key)[0] == "success"
    assert [op for op, r in driver.calls if r == rid].count("get_status") == 3
    assert driver.live == {} and wl.ti.key not in executor.running
    assert (logs / wl.log_path).read_bytes() == task_log  # copied out of the sandbox as it was
    request = driver.launched[0]
    assert request.command[1:3] == ("-m", "airflow.sdk.execution_time.execute_workload")
    labels = request.provider_config["labels"]
    assert labels["dag_id"] == "unit" and labels["try_number"] == "1"


def test_a_failed_try_reports_the_exit_and_the_outputs_last_lines(
    executor: Any, driver: FakeSandboxDriver, logs: Path
) -> None:
    wl = workload()
    lines = "\n".join(f"line {i}" for i in range(30))
    driver.plan(
        wl.ti.external_executor_id, [FAILED_3], output=SandboxOutput(stdout=lines, stderr="Traceback: boom")
    )
    executor.queue_workload(wl, session=None)
    state, info = final_event(executor, wl.ti.key)
    assert state == "failed" and "exit code 3" in info
    events = log_events(logs, wl)
    assert events[0].startswith("PandaStackExecutor: sandbox sb-") and "exit code 3" in events[0]
    assert events[1] == "PandaStackExecutor: last 20 line(s) of the sandbox's output:"
    assert events[2] == "line 11" and events[-1] == "Traceback: boom"
    assert driver.live == {}


def test_a_lost_sandbox_fails_the_try_without_reading_from_it(
    executor: Any, driver: FakeSandboxDriver
) -> None:
    wl = workload()
    driver.plan(
        wl.ti.external_executor_id, [SandboxResult(SandboxState.GONE, message="sandbox lost: reaped")]
    )
    executor.queue_workload(wl, session=None)
    state, info = final_event(executor, wl.ti.key)
    assert state == "failed" and "sandbox lost: reaped" in info
    ops = [op for op, _ in driver.calls]
    assert "read_file" not in ops and "get_output" not in ops and "terminate" in ops


def test_a_launch_error_fences_the_request_and_fails_the_try(
    executor: Any, driver: FakeSandboxDriver, logs: Path
) -> None:
    wl = workload()
    rid = wl.ti.external_executor_id
    driver.plan(rid, launch_error=RuntimeError("sandbox launch failed (server_error): boom"))
    executor.queue_workload(wl, session=None)
    state, info = final_event(executor, wl.ti.key)
    assert state == "failed" and "boom" in info
    assert ("fence", rid) in driver.calls and driver.live == {}  # a create that went through is deleted
    assert any("boom" in e for e in log_events(logs, wl))


def test_a_capacity_refusal_requeues_after_retry_after_without_failing(
    executor: Any, driver: FakeSandboxDriver
) -> None:
    wl = workload()
    driver.fail("launch", SandboxCapacityError("no compute capacity available", retry_after=0.05))
    executor.queue_workload(wl, session=None)
    beat_until(executor, lambda: wl.ti.key in executor._deferred)
    assert wl.ti.key not in executor.event_buffer
    due = executor._deferred[wl.ti.key][0]
    assert due - executor.clock() == pytest.approx(0.05)  # requeued after Retry-After, on the fake clock
    assert final_event(executor, wl.ti.key)[0] == "success"
    assert [op for op, _ in driver.calls].count("launch") == 2


def test_polling_errors_back_off_and_the_try_still_finishes(executor: Any, driver: FakeSandboxDriver) -> None:
    wl = workload()
    driver.fail("get_status", ConnectionError("api down"), times=3)
    executor.queue_workload(wl, session=None)
    assert final_event(executor, wl.ti.key)[0] == "success"
    polls = [t for (op, _), t in zip(driver.calls, driver.call_times, strict=True) if op == "get_status"]
    gaps = [b - a for a, b in itertools.pairwise(polls)]
    # each failure doubles the wait (poll_interval 1 ms): 2, 4, 8 ms at least
    assert len(gaps) == 3 and all(gap >= 0.001 * 2 ** (i + 1) for i, gap in enumerate(gaps)), gaps


def test_a_bad_executor_config_fails_the_try_before_any_sandbox(
    executor: Any, driver: FakeSandboxDriver, logs: Path
) -> None:
    wl = workload(executor_config={"pandastack": {"cpus": 4}})
    executor.queue_workload(wl, session=None)
    executor.heartbeat()
    state, info = executor.event_buffer[wl.ti.key]
    assert str(state) == "failed" and "unknown option(s) cpus" in info
    assert driver.launched == [] and "task not started" in log_events(logs, wl)[0]


def test_executor_config_overlays_the_defaults(executor: Any, driver: FakeSandboxDriver) -> None:
    wl = workload(executor_config={"pandastack": {"timeout": 60, "env": {"TZ": "UTC"}, "template": "base"}})
    executor.queue_workload(wl, session=None)
    final_event(executor, wl.ti.key)
    request = driver.launched[0]
    assert (request.provider_config["template"], request.timeout_seconds) == ("base", 60)
    assert request.ttl_seconds == 60 + 60  # the core's rule: the timeout plus TTL_MARGIN_SECONDS
    env = driver.launched[0].env
    assert (
        env["TZ"] == "UTC"
        and env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://api.invalid/execution/"
    )
    assert not any("SQL_ALCHEMY_CONN" in name or "FERNET" in name for name in env)


def test_a_try_without_a_preassigned_uuid_is_refused_with_the_alias(
    executor: Any, driver: FakeSandboxDriver
) -> None:
    wl = workload(external_executor_id=None)
    executor.queue_workload(wl, session=None)
    executor.heartbeat()
    state, info = executor.event_buffer[wl.ti.key]
    assert (
        str(state) == "failed" and "PandaStackExecutor:airflow_provider.executors.PandaStackExecutor" in info
    )
    assert driver.launched == []


def test_revoking_a_running_try_deletes_its_sandbox_and_reports_nothing(
    executor: Any, driver: FakeSandboxDriver
) -> None:
    wl = running_try(executor, driver)
    rid = wl.ti.external_executor_id
    executor.event_buffer.clear()
    executor.revoke_task(ti=wl.ti)
    beat_until(executor, lambda: rid not in driver.live and not executor._fences)
    assert wl.ti.key not in executor.running and wl.ti.key not in executor.event_buffer


def test_a_failing_fence_is_retried_until_it_holds(executor: Any, driver: FakeSandboxDriver) -> None:
    wl = running_try(executor, driver)
    rid = wl.ti.external_executor_id
    driver.fail("fence", RuntimeError("api down"), times=2)
    executor.revoke_task(ti=wl.ti)
    beat_until(executor, lambda: rid not in driver.live and not executor._fences)
    assert driver.calls.count(("fence", rid)) == 3


def test_adoption_keeps_persisted_tries_and_fences_unpersisted_ones(
    executor: Any, driver: FakeSandboxDriver
) -> None:
    from airflow_provider.executors.models import SandboxHandle

    persisted, unpersisted, foreign = workload(), workload(), workload(external_executor_id="celery-123")
    handle = driver.add_live(persisted.ti.external_executor_id)
    driver.add_live(unpersisted.ti.external_executor_id)
    ref = SandboxExecutionRef(
        "pandastack", persisted.ti.external_executor_id, SandboxHandle(handle.data, "sb")
    )
    persisted.ti.external_executor_id = ref.encode()
    not_adopted = executor.try_adopt_task_instances([persisted.ti, unpersisted.ti, foreign.ti])
    assert not_adopted == [unpersisted.ti, foreign.ti]
    assert persisted.ti.key in executor._active
    assert unpersisted.ti.external_executor_id not in driver.live  # fenced before Airflow reschedules it
    assert final_event(executor, persisted.ti.key)[0] == "success"


def test_a_recoverable_unpersisted_try_is_adopted_with_a_new_running_event(
    executor: Any, driver: FakeSandboxDriver
) -> None:
    wl = workload()
    rid = wl.ti.external_executor_id
    driver.add_live(rid)
    driver.plan(rid, [RUNNING], recoverable=True)
    assert executor.try_adopt_task_instances([wl.ti]) == []
    state, info = executor.event_buffer[wl.ti.key]
    assert str(state) == "running" and SandboxExecutionRef.decode(info).request_id == rid  # type: ignore[union-attr]


def test_terminate_deletes_every_sandbox_the_executor_runs(logs: Path, driver: FakeSandboxDriver) -> None:
    from airflow_provider.executors import PandaStackExecutor

    ex = PandaStackExecutor(parallelism=4)

    settled(ex, driver)
    ex.make_driver = lambda: driver  # type: ignore[method-assign]
    ex.start()
    loads = [workload() for _ in range(3)]
    for wl in loads:
        driver.plan(wl.ti.external_executor_id, [RUNNING])
        ex.queue_workload(wl, session=None)
    beat_until(ex, lambda: len(ex._active) == 3)
    ex.terminate()
    assert driver.live == {} and ex.running == set()


def test_an_unhealthy_service_stops_the_start(logs: Path, driver: FakeSandboxDriver) -> None:
    from airflow_provider.executors import PandaStackExecutor

    driver.fail("health_check", PermissionError("invalid api token"))
    ex = PandaStackExecutor(parallelism=1)
    settled(ex, driver)
    ex.make_driver = lambda: driver  # type: ignore[method-assign]
    with pytest.raises(PermissionError, match="invalid api token"):
        ex.start()
    assert ex._loop is None


def test_the_orphan_sweep_copies_an_ended_trys_log_and_fences_it_and_leaves_owned_ones(
    logs: Path, driver: FakeSandboxDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The metadata-DB lookup (``orphans.ended_tries``) is the one seam replaced here: the sweep's
    bookkeeping around it (what is owned, what is collected, where the log goes) is real."""
    from airflow_provider.executors import PandaStackExecutor
    from airflow_provider.executors.models import SandboxHandle

    monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__ORPHAN_SWEEP_INTERVAL", "60")
    ended_rid, running = str(uuid.uuid4()), workload()
    handle = driver.add_live(ended_rid, {"dag_id": "d", "task_id": "t", "run_id": "r", "map_index": "-1"})
    ref = SandboxExecutionRef(
        "pandastack", ended_rid, SandboxHandle({**handle.data, "log_path": "o/1.log"}, "sb")
    )
    driver.plan(ended_rid, files={"/work/logs/o/1.log": b"the orphan's log\n"})
    asked: list[set[str]] = []

    def ended_tries(candidates: dict[str, dict[str, str]]) -> dict[str, Any]:
        asked.append(set(candidates))
        return {ended_rid: ref} if ended_rid in candidates else {}

    ex = PandaStackExecutor(parallelism=4)

    settled(ex, driver)
    ex.orphans.ended_tries = ended_tries  # type: ignore[method-assign]
    ex.make_driver = lambda: driver  # type: ignore[method-assign]
    ex.start()
    try:
        driver.plan(running.ti.external_executor_id, [RUNNING])
        ex.queue_workload(running, session=None)
        beat_until(ex, lambda: running.ti.key in ex._active)
        ex.orphans.next_sweep = 0.0
        beat_until(ex, lambda: ended_rid not in driver.live and not ex.orphans.collecting)
        assert (logs / "o" / "1.log").read_bytes() == b"the orphan's log\n"
        assert all(running.ti.external_executor_id not in c for c in asked)  # owned: never a candidate
        assert running.ti.external_executor_id in driver.live
    finally:
        ex.shutdown_timeout = 2
        ex.end()
