"""What the executor's unit tests share: scripted results, an ``ExecuteTask`` as the scheduler
hands it over, and heartbeating until something holds (fixtures: conftest.py)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow_provider.executors.models import SandboxResult, SandboxState

RUNNING = SandboxResult(SandboxState.RUNNING)
FAILED_3 = SandboxResult(
    SandboxState.FAILED, exit_code=3, message="the task's sandbox workload ended with exit code 3"
)


def workload(**ti_fields: Any) -> Any:
    """An ExecuteTask as the scheduler hands it over, with a pre-assigned try UUID."""
    from airflow.executors.workloads import BundleInfo, ExecuteTask
    from airflow.executors.workloads.task import TaskInstanceDTO

    fields: dict[str, Any] = {
        "id": uuid.uuid4(),
        "dag_id": "unit",
        "task_id": "t",
        "run_id": f"r-{uuid.uuid4().hex[:6]}",
        "try_number": 1,
        "dag_version_id": uuid.uuid4(),
        "pool_slots": 1,
        "priority_weight": 1,
        "external_executor_id": str(uuid.uuid4()),
    }
    fields.update(ti_fields)
    ti = TaskInstanceDTO(**fields)
    log_path = f"dag_id=unit/run_id={ti.run_id}/task_id=t/attempt={ti.try_number}.log"
    return ExecuteTask(
        ti=ti,
        dag_rel_path=Path("unit.py"),
        bundle_info=BundleInfo(name="dags-folder"),
        log_path=log_path,
        token="tok",
    )


def settled(executor: Any, driver: Any) -> Any:
    """``executor`` (not started) on ``driver``, its calls settled at once and its time the driver's
    fake clock (what conftest's make_executor does)."""
    from airflow_provider.executors.testing import SettledLoop

    executor.make_driver = lambda: driver
    executor.make_loop = SettledLoop
    executor.clock, executor.sleep = driver.clock, driver.clock.advance
    return executor


def skip_waits(executor: Any) -> None:
    """Move the executor's fake clock to the next thing due (a poll, a requeue, a fence retry, a
    sweep) when nothing is due now: a wait costs no time and its length stays exact."""
    now = executor.clock()
    due = [*executor._next_poll.values(), *(when for when, _ in executor._deferred.values())]
    due += [f.next_attempt for f in executor._fences.values() if f.future is None]
    if executor.orphans.interval > 0:
        due.append(executor.orphans.next_sweep)
    if due and min(due) > now:
        executor.clock.advance_to(min(due))


def beat_until(executor: Any, done: Callable[[], bool], beats: int = 200) -> None:
    """Heartbeat until ``done()``, skipping waits; fails after ``beats`` heartbeats (no wall clock:
    with every driver call settled at once, a heartbeat's outcome is fixed)."""
    for _ in range(beats):
        if done():
            return
        executor.heartbeat()
        if done():
            return
        skip_waits(executor)
    assert done(), f"not reached in {beats} heartbeats; buffer={executor.event_buffer}"


def final_event(executor: Any, key: Any) -> tuple[str, Any]:
    def ended() -> bool:
        event = executor.event_buffer.get(key)
        return event is not None and str(event[0]) in ("success", "failed")

    beat_until(executor, ended)
    state, info = executor.event_buffer[key]
    return str(state), info


def log_events(logs: Path, wl: Any) -> list[str]:
    return [
        json.loads(line)["event"]
        for line in (logs / wl.log_path).read_text().splitlines()
        if line.startswith("{")
    ]


def running_try(executor: Any, driver: Any, **ti_fields: Any) -> Any:
    """A queued try whose sandbox runs until told otherwise, once the executor polls it."""
    wl = workload(**ti_fields)
    driver.plan(wl.ti.external_executor_id, [RUNNING])
    executor.queue_workload(wl, session=None)
    beat_until(executor, lambda: wl.ti.key in executor._active)
    return wl
