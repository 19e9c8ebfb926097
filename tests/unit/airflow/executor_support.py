"""What the executor's unit tests share: scripted results, an ``ExecuteTask`` as the scheduler
hands it over, and heartbeating until something holds (fixtures: conftest.py)."""

from __future__ import annotations

import json
import time
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


def beat_until(executor: Any, done: Callable[[], bool], limit: float = 5.0) -> None:
    deadline = time.monotonic() + limit
    while not done():
        assert time.monotonic() < deadline, f"not reached; buffer={executor.event_buffer}"
        executor.heartbeat()
        time.sleep(0.002)


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
