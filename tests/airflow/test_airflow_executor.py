"""``PandaStackExecutor`` driven the way the scheduler drives it, against a real pandastack-local.

The scheduler's side (queue_workload, heartbeat, the event buffer, adoption after a
restart) is exercised directly on a real executor; every sandbox is real. Here the
sandbox runs the standard Task SDK workload command with the host's bare Python,
which has no Airflow: the try fails for real, and the failure path (exit code and the
output's last lines in the task log, no sandbox left) is what is checked. Whole task
tries through a scheduler are in test_airflow_executor_scheduler.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from airflow_provider.executors.driver import REQUEST_LABEL, PandaStackDriver
from airflow_provider.executors.models import (
    SandboxExecutionRef,
    SandboxHandle,
    SandboxLaunchRequest,
)
from pandastack_jobs import ConnectionConfig


@pytest.fixture
def executor_env(airflow_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Executor settings: the host's bare python3 in the sandbox, logs in a fresh folder."""
    monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__PYTHON", "/usr/bin/python3")
    monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__POLL_INTERVAL", "0.2")
    monkeypatch.setenv("AIRFLOW__LOGGING__BASE_LOG_FOLDER", str(tmp_path / "logs"))
    return tmp_path / "logs"


def _workload(executor_config: dict[str, Any] | None = None, try_number: int = 1) -> Any:
    from airflow.executors.workloads import BundleInfo, ExecuteTask
    from airflow.executors.workloads.task import TaskInstanceDTO

    run_id = f"manual__{uuid.uuid4().hex[:8]}"
    ti = TaskInstanceDTO(
        id=uuid.uuid4(),
        task_id="t",
        dag_id="executor_unit",
        run_id=run_id,
        try_number=try_number,
        dag_version_id=uuid.uuid4(),
        pool_slots=1,
        priority_weight=1,
        external_executor_id=str(uuid.uuid4()),
        executor_config=executor_config,
    )
    return ExecuteTask(
        ti=ti,
        dag_rel_path=Path("executor_unit.py"),
        bundle_info=BundleInfo(name="dags-folder"),
        log_path=f"dag_id=executor_unit/run_id={run_id}/task_id=t/attempt={try_number}.log",
        token="task-scoped-token",
    )


def _executor() -> Any:
    from airflow_provider.executors import PandaStackExecutor

    executor = PandaStackExecutor(parallelism=4)
    executor.start()
    return executor


@contextmanager
def _running_executor() -> Iterator[Any]:
    """A started executor, ended however the test leaves."""
    executor = _executor()
    try:
        yield executor
    finally:
        executor.end()


def _final_event(executor: Any, workload: Any) -> tuple[Any, Any]:
    """Queue ``workload`` as the scheduler does and heartbeat until its final event."""
    executor.queue_workload(workload, session=None)
    executor.heartbeat()
    return _until_event(executor, workload.ti.key)


def _until_event(executor: Any, key: Any, limit: float = 90) -> tuple[Any, Any]:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        executor.heartbeat()
        event = executor.event_buffer.get(key)
        if event is not None and str(event[0]) in ("success", "failed"):
            return event
        time.sleep(0.2)
    raise AssertionError(f"no final event for {key}; buffer={executor.event_buffer}")


def _log_records(folder: Path, workload: Any) -> list[dict[str, Any]]:
    path = folder / workload.log_path
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_failed_try_reports_exit_code_and_last_lines_in_the_task_log(
    executor_env: Path, local_server: Any
) -> None:
    workload = _workload()
    with _running_executor() as executor:
        state, info = _final_event(executor, workload)
        assert str(state) == "failed"
        assert "exit code 1" in info
        events = [r["event"] for r in _log_records(executor_env, workload)]
        assert any("exit code 1" in e and "PandaStackExecutor" in e for e in events)
        assert any("No module named" in e for e in events), events  # the sandbox's own last lines
        assert local_server.client().sandboxes.list() == []
        assert workload.ti.key not in executor.running


def test_the_handle_is_persisted_through_the_running_event(executor_env: Path, local_server: Any) -> None:
    """The scheduler stores a RUNNING event's info in external_executor_id: that is the handle."""
    executor = _executor()
    workload = _workload()
    try:
        executor.queue_workload(workload, session=None)
        deadline = time.monotonic() + 30
        persisted = None
        while persisted is None and time.monotonic() < deadline:
            executor.heartbeat()
            event = executor.event_buffer.get(workload.ti.key)
            if event and str(event[0]) == "running":
                persisted = event[1]
            time.sleep(0.05)
        assert persisted is not None, executor.event_buffer
        ref = SandboxExecutionRef.decode(persisted, expected_driver="pandastack")
        assert ref is not None and ref.request_id == workload.ti.external_executor_id
        assert ref.handle.data["log_path"] == workload.log_path
        _until_event(executor, workload.ti.key)
        assert local_server.client().sandboxes.list() == []
    finally:
        executor.end()


def test_reserved_env_fails_the_try_with_a_clear_error_and_no_sandbox(
    executor_env: Path, local_server: Any
) -> None:
    executor = _executor()
    workload = _workload({"pandastack": {"env": {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "sqlite://"}}})
    try:
        executor.queue_workload(workload, session=None)
        executor.heartbeat()
        state, info = executor.event_buffer[workload.ti.key]
        assert str(state) == "failed"
        assert "reserved Airflow variables" in info and "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN" in info
        assert any("reserved Airflow variables" in r["event"] for r in _log_records(executor_env, workload))
        assert local_server.client().sandboxes.list() == []
    finally:
        executor.end()


def test_capacity_refusal_requeues_after_retry_after(
    executor_env: Path, make_local_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.support.dagtest import connection_env

    server = make_local_server(max_sandboxes=1, pool_size=0)
    monkeypatch.setenv(*next(iter(connection_env(server, create_budget=0).items())))
    client = server.client()
    blocker = client.sandboxes.create(template="code-interpreter")
    executor = _executor()
    workload = _workload()
    key = workload.ti.key
    try:
        executor.queue_workload(workload, session=None)
        deadline = time.monotonic() + 20
        while key not in executor._deferred and time.monotonic() < deadline:
            executor.heartbeat()
            time.sleep(0.05)
        assert key in executor._deferred, "the refusal was not turned into a delayed requeue"
        assert key not in executor.event_buffer  # not failed
        client.sandboxes.delete(blocker.id)
        state, info = _until_event(executor, key)
        # Requeued and launched once capacity came back; the bare python then fails for real.
        assert str(state) == "failed" and "exit code 1" in info
        assert client.sandboxes.list() == []
    finally:
        executor.end()


def _launch_direct(
    server: Any, argv: list[str], rid: str, labels: dict[str, str] | None = None
) -> SandboxHandle:
    driver = PandaStackDriver(ConnectionConfig(api_url=server.url, api_key=server.api_key))
    request = SandboxLaunchRequest(
        request_id=rid,
        command=tuple(argv),
        env={},
        provider_config={"template": "code-interpreter", "labels": labels or {}},
        workdir=None,
        timeout_seconds=60,
        ttl_seconds=120,
    )
    return asyncio.run(driver.launch(request))


def test_restarted_scheduler_adopts_persisted_and_fences_unpersisted(
    executor_env: Path, local_server: Any
) -> None:
    """A new executor adopts a try whose handle was persisted and fences one whose handle was not."""
    from airflow.models.taskinstancekey import TaskInstanceKey

    persisted_rid, bare_rid = str(uuid.uuid4()), str(uuid.uuid4())
    handle = _launch_direct(local_server, ["sh", "-c", "sleep 2; exit 0"], persisted_rid)
    ref = SandboxExecutionRef("pandastack", persisted_rid, handle)
    orphan = local_server.client().sandboxes.create(
        template="code-interpreter", metadata={REQUEST_LABEL: bare_rid}
    )
    adopted = SimpleNamespace(
        key=TaskInstanceKey("d", "adopted", "r", 1, -1), external_executor_id=ref.encode()
    )
    unpersisted = SimpleNamespace(key=TaskInstanceKey("d", "bare", "r", 1, -1), external_executor_id=bare_rid)
    foreign = SimpleNamespace(
        key=TaskInstanceKey("d", "celery", "r", 1, -1), external_executor_id="celery-id"
    )
    executor = _executor()
    try:
        not_adopted = executor.try_adopt_task_instances([adopted, unpersisted, foreign])
        assert [ti.key.task_id for ti in not_adopted] == ["bare", "celery"]
        left = {sb.id for sb in local_server.client().sandboxes.list()}
        assert orphan.id not in left, "the un-persisted try was not fenced before rescheduling"
        assert handle.display_name in left
        state, _ = _until_event(executor, adopted.key)
        assert str(state) == "success"
        assert local_server.client().sandboxes.list() == []
    finally:
        executor.end()


def test_orphan_sweep_deletes_the_sandbox_of_a_try_that_ended_without_a_scheduler(
    executor_env: Path, local_server: Any
) -> None:
    """The scheduler died; the try finished (its TI is success) before a new one came, so Airflow
    offers it to nobody for adoption. A new executor's sweep copies its log out and deletes its
    sandbox; a sandbox with the same names whose request id the TI does not carry (another
    deployment on the same account) is left alone."""
    from datetime import datetime, timedelta, timezone

    from airflow.models.taskinstance import TaskInstance
    from airflow.sdk import dag, task
    from airflow.utils.session import create_session
    from sqlalchemy import update

    from tests.support.dagtest import run_dag, task_instances

    @dag(dag_id=f"orphan_{uuid.uuid4().hex[:8]}", schedule=None)
    def orphan_dag() -> None:
        task(task_id="t")(lambda: 1)()

    ti = task_instances(run_dag(orphan_dag()))[("t", -1)]
    assert str(ti.state) == "success"
    labels = {
        "dag_id": ti.dag_id,
        "task_id": "t",
        "run_id": ti.run_id,
        "map_index": "-1",
        "try_number": str(ti.try_number),
    }
    rid, foreign_rid = str(uuid.uuid4()), str(uuid.uuid4())
    write_log = "mkdir -p /work/logs/orphan && echo the task log line > /work/logs/orphan/attempt=1.log"
    ours = _launch_direct(local_server, ["sh", "-c", write_log], rid, labels)
    foreign = _launch_direct(local_server, ["sleep", "60"], foreign_rid, labels)
    ref = SandboxExecutionRef(
        "pandastack", rid, SandboxHandle({**ours.data, "log_path": "orphan/attempt=1.log"}, ours.display_name)
    )
    ended = datetime.now(timezone.utc) - timedelta(minutes=5)  # past the sweep's grace
    with create_session() as session:
        session.execute(
            update(TaskInstance)
            .where(TaskInstance.id == ti.id)
            .values(external_executor_id=ref.encode(), end_date=ended)
        )

    def live() -> set[str]:
        return {sb.id for sb in local_server.client().sandboxes.list()}

    executor = _executor()
    try:
        deadline = time.monotonic() + 60
        while ours.display_name in live() and time.monotonic() < deadline:
            executor.heartbeat()
            time.sleep(0.2)
        executor.heartbeat()  # the sweep writes the copied log on the heartbeat after the delete
        assert ours.display_name not in live(), "the ended try's sandbox was not swept"
        assert foreign.display_name in live(), "the sweep deleted a sandbox that is not this try's"
        assert "the task log line" in (executor_env / "orphan" / "attempt=1.log").read_text()
    finally:
        executor.end()
        local_server.client().sandboxes.get(foreign.display_name).kill()


def test_revoke_deletes_the_sandbox(executor_env: Path, local_server: Any) -> None:
    from airflow.models.taskinstancekey import TaskInstanceKey

    rid = str(uuid.uuid4())
    handle = _launch_direct(local_server, ["sleep", "60"], rid)
    ref = SandboxExecutionRef("pandastack", rid, handle)
    ti = SimpleNamespace(key=TaskInstanceKey("d", "killed", "r", 1, -1), external_executor_id=ref.encode())
    executor = _executor()
    try:
        assert executor.try_adopt_task_instances([ti]) == []
        executor.revoke_task(ti=ti)
        deadline = time.monotonic() + 20
        while local_server.client().sandboxes.list() and time.monotonic() < deadline:
            executor.heartbeat()
            time.sleep(0.1)
        assert local_server.client().sandboxes.list() == []
        assert ti.key not in executor.running and ti.key not in executor.event_buffer
    finally:
        executor.end()


def test_provider_info_and_multiple_executors_config(airflow_env: dict[str, str]) -> None:
    """Listed in the provider info; beside LocalExecutor, a task's executor="PandaStackExecutor" resolves."""
    from airflow_provider.get_provider_info import get_provider_info
    from tests.support.dagtest import AIRFLOW_BIN

    assert "airflow_provider.executors.PandaStackExecutor" in get_provider_info()["executors"]
    code = (
        "from airflow.executors.executor_loader import ExecutorLoader as L\n"
        "print([str(n) for n in L.get_executor_names()])\n"
        "n = L.lookup_executor_name_by_str('PandaStackExecutor')\n"
        "print(n.module_path, L.import_executor_cls(n)[0].pre_assigns_external_executor_id)\n"
    )
    python = str(Path(AIRFLOW_BIN).with_name("python"))
    env = {
        **os.environ,
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor,airflow_provider.executors.PandaStackExecutor",
    }
    proc = subprocess.run(
        [python, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    names, resolved = proc.stdout.strip().splitlines()[-2:]
    assert "LocalExecutor" in names and "airflow_provider.executors.PandaStackExecutor" in names
    assert resolved == "airflow_provider.executors.PandaStackExecutor True"


def test_launch_request_carries_only_the_workload_and_runtime_env(
    executor_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request that leaves the scheduler: the standard command, and no scheduler secret."""
    from airflow_provider.executors import PandaStackExecutor

    monkeypatch.setenv("AIRFLOW__CORE__FERNET_KEY", "fernet-key-that-must-stay-home")
    monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__ENV", json.dumps({"TZ": "UTC"}))
    workload = _workload({"pandastack": {"env": {"TENANT": "acme"}, "timeout": 30}})
    request = PandaStackExecutor(parallelism=1).launch_request(workload)
    assert request.request_id == workload.ti.external_executor_id
    assert list(request.command[1:4]) == [
        "-m",
        "airflow.sdk.execution_time.execute_workload",
        "--json-string",
    ]
    assert json.loads(request.command[4])["token"] == "task-scoped-token"
    assert request.env["TZ"] == "UTC" and request.env["TENANT"] == "acme"
    assert (request.timeout_seconds, request.ttl_seconds) == (30, 30 + 60)  # the core's TTL rule
    runtime = {k for k in request.env if k.startswith("AIRFLOW")}
    allowed = {
        "AIRFLOW_HOME",
        "AIRFLOW_IS_EXECUTOR_CONTAINER",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL",
        "AIRFLOW__CORE__DAGS_FOLDER",
        "AIRFLOW__CORE__LOAD_EXAMPLES",
        "AIRFLOW__CORE__EXECUTOR",
        "AIRFLOW__LOGGING__BASE_LOG_FOLDER",
    }
    assert runtime - allowed <= {k for k in runtime if k.startswith("AIRFLOW__WORKERS__EXECUTION_API_")}
    everything = json.dumps([request.command, request.env])
    for secret in (os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"], "fernet-key-that-must-stay-home"):
        assert secret not in everything


PER_TASK_EXECUTOR_DAG = """
from airflow.sdk import dag, task


@dag(dag_id="per_task_executor", schedule=None)
def per_task_executor():
    task(task_id="isolated", executor="PandaStackExecutor")(lambda: 1)()


per_task_executor()
"""


def test_a_task_with_executor_pandastack_parses_inside_the_sandbox(
    executor_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The sandbox's Airflow parses the DAG again and checks each task's ``executor=`` against
    its own ``[core] executor``: the sandbox must get the scheduler's list (no secret in it)."""
    from airflow_provider.executors import PandaStackExecutor

    executors = "LocalExecutor,airflow_provider.executors.PandaStackExecutor"
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", executors)
    (tmp_path / "per_task_executor.py").write_text(PER_TASK_EXECUTOR_DAG)
    request = PandaStackExecutor(parallelism=1).launch_request(_workload())
    # Exactly the sandbox's environment (its AIRFLOW_HOME moved to a scratch dir on this host).
    env = {**request.env, "AIRFLOW_HOME": str(tmp_path / "home"), "PATH": os.environ["PATH"]}
    parse = (
        "import json, sys; from airflow.dag_processing.dagbag import DagBag; "
        "bag = DagBag(dag_folder=sys.argv[1]); "
        "errors = [str(e) for e in bag.import_errors.values()]; "
        "print(json.dumps({'dags': sorted(bag.dag_ids), 'errors': errors}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", parse, str(tmp_path)],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert parsed == {"dags": ["per_task_executor"], "errors": []}, parsed
    assert request.env["AIRFLOW__CORE__EXECUTOR"] == executors


def test_a_try_without_a_preassigned_uuid_fails_with_the_alias_to_configure(executor_env: Path) -> None:
    """Beside LocalExecutor, Airflow pre-assigns the UUID only to tasks whose executor= is the
    configured alias or module path (executor="PandaStackExecutor" without the alias gets none)."""
    from airflow_provider.executors import PandaStackExecutor
    from airflow_provider.executors.models import SandboxConfigurationError

    workload = _workload()
    workload.ti.external_executor_id = None
    with pytest.raises(SandboxConfigurationError) as err:
        PandaStackExecutor(parallelism=1).launch_request(workload)
    assert "PandaStackExecutor:airflow_provider.executors.PandaStackExecutor" in str(err.value)
