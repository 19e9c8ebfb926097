"""``PandaStackExecutor`` beside ``CeleryExecutor`` (Airflow's multiple executors) on PostgreSQL.

One stack for the whole module: a pandastack-local server whose ``airflow-worker`` template binds
this venv read-only and the repository (DAGs, editable provider), with egress to the api-server's
port only; ``airflow api-server``; ``airflow scheduler`` with
``executor = CeleryExecutor,airflow_provider.executors.PandaStackExecutor``; one Celery worker.
A sampler records every sandbox the server ever lists, so "one sandbox per try" and
"launched once" are counted from the server's view.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pandastack_jobs import Engine
from pandastack_local.testing.waiting import wait_for

from .airflow_stack import AF_BIN, AirflowStack, _celery_ping, airflow_env
from .procs import Proc, ProcessGroup, free_port, run
from .services import REPO, PandaStack, Postgres, Redis, start_pandastack

pytestmark = pytest.mark.timeout(900)

DAGS = REPO / "e2e" / "executor_dags"
WORKER = "worker-x"
TEMPLATE = "airflow-worker"
ENGINE = Engine.AIRFLOW_EXECUTOR


@dataclass
class Seen:
    """Every executor sandbox the server listed while the module ran: id -> metadata."""

    ps: PandaStack
    sandboxes: dict[str, dict[str, str]] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def sample(self) -> None:
        while not self.stop.is_set():
            try:
                for sb in self.ps.sandboxes():
                    meta = sb.get("metadata") or {}
                    if meta.get("job_engine") == ENGINE:
                        self.sandboxes.setdefault(sb["id"], meta)
            except OSError as exc:  # a busy server may miss a sample; the next one counts
                print(f"sandbox sampler: {exc}")
            self.stop.wait(0.3)

    def of(self, run_id: str, task_id: str) -> list[str]:
        match = {"job_run": run_id, "job_task": task_id}
        return [i for i, m in self.sandboxes.items() if all(m.get(k) == v for k, v in match.items())]


@dataclass
class ExecutorStack:
    airflow: AirflowStack
    ps: PandaStack
    seen: Seen
    markers: Path
    scheduler: Proc

    def live(self, **match: str) -> list[dict[str, Any]]:
        return self.ps.engine_sandboxes(ENGINE, **match)

    def trigger(self, dag_id: str) -> str:
        return self.airflow.trigger(dag_id, {"marker_dir": str(self.markers)})

    def start_scheduler(self, name: str) -> Proc:
        self.scheduler = self.airflow.group.start(
            name, [str(AF_BIN / "airflow"), "scheduler"], env=self.airflow.env
        )
        return self.scheduler

    def release(self, run_id: str, task_id: str) -> None:
        key = f"e2e_release__{run_id}__{task_id}"
        self.airflow.request("POST", "/variables", {"key": key, "value": "go"})

    def starts(self, run_id: str, task_id: str) -> int:
        return int(self.airflow.request("GET", f"/variables/e2e_starts__{run_id}__{task_id}")["value"])


@pytest.fixture(scope="module")
def stack(group: ProcessGroup, postgres: Postgres, redis: Redis) -> Iterator[ExecutorStack]:
    home = group.run_dir / "airflow-executor"
    template = home / "template"
    template.mkdir(parents=True)
    template.chmod(0o755)
    (template / "template.json").write_text(
        json.dumps(
            {
                "name": TEMPLATE,
                "python_env": sys.prefix,  # the workers' own environment, bound read-only
                "code_dirs": [str(REPO)],  # the DAG folder and the editable provider's source
                "memory_mb": 1024,
            }
        )
    )
    api_port = free_port()
    extra = ["--template-dir", str(template), "--allow-egress", f"127.0.0.1:{api_port}"]
    with group.stopping("executor-"):
        ps = start_pandastack(group, sys.executable, name="executor-pandastack", extra_args=extra)
        postgres.create_db("airflow_executor")
        env = airflow_env(group.run_dir, postgres, redis, ps, api_port)
        env.pop("AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST")  # the dags-folder bundle only
        db = postgres.url("airflow_executor")
        env.update(
            {
                "AIRFLOW_HOME": str(home),
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": db,
                "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + db,
                "AIRFLOW__CELERY__BROKER_URL": redis.url.rsplit("/", 1)[0] + "/1",  # not the Celery module's
                "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor,airflow_provider.executors.PandaStackExecutor",
                "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
                "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(home / "logs"),
                "AIRFLOW__PANDASTACK_EXECUTOR__TEMPLATE": TEMPLATE,
                "AIRFLOW__PANDASTACK_EXECUTOR__POLL_INTERVAL": "0.5",
                "AIRFLOW__PANDASTACK_EXECUTOR__TIMEOUT": "600",
                "AIRFLOW__PANDASTACK_EXECUTOR__ORPHAN_SWEEP_INTERVAL": "5",
                # A loaded machine answers slowly: the tasks' API client waits longer (passed in).
                "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "120",
                # A SIGKILLed scheduler's tries are adopted within ~30 s, not the default 5 min.
                "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD": "20",
                "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "5",
            }
        )
        airflow = str(AF_BIN / "airflow")
        run([airflow, "db", "migrate"], env=env, timeout=400, log=group.log_dir / "executor-db.log")
        run([airflow, "dags", "reserialize"], env=env, timeout=300, log=group.log_dir / "executor-db.log")
        stack = AirflowStack(group, env, api_port)
        group.start(
            "executor-api-server",
            [airflow, "api-server", "--host", "127.0.0.1", "--port", str(api_port), "--workers", "1"],
            env=env,
            ports=[api_port],
        )
        scheduler = group.start("executor-scheduler", [airflow, "scheduler"], env=env)
        worker = stack.start_worker(WORKER)
        seen = Seen(ps)
        sampler = threading.Thread(target=seen.sample, daemon=True)
        sampler.start()
        try:
            wait_for("the Airflow API server", stack.token, timeout=180, interval=0.5)
            wait_for(
                "the Celery worker",
                lambda: _celery_ping(env),
                timeout=180,
                interval=3,
                check=lambda names: any(n.startswith(WORKER + "@") for n in names),
                on_timeout=lambda: worker.tail(30),
            )
            markers = group.run_dir / "host-markers"
            markers.mkdir()
            yield ExecutorStack(stack, ps, seen, markers, scheduler)
        finally:
            seen.stop.set()
            sampler.join(timeout=10)
            worker.stop()
            for proc in group.procs:  # before the server, which their executor would miss at every sweep
                if proc.name.startswith("executor-scheduler"):
                    proc.stop()


def reports(stack: ExecutorStack, dag_id: str, run_id: str, task_ids: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for task_id in task_ids:
        value = stack.airflow.xcom(dag_id, run_id, task_id)
        out[task_id] = json.loads(value) if isinstance(value, str) else value
    return out


def assert_in_own_sandbox(stack: ExecutorStack, dag_id: str, run_id: str, where: dict[str, Any]) -> None:
    """Each try ran in its own sandbox: an id read inside, the server's sandbox for that try, PID 1."""
    ids = {w["sandbox_id"] for w in where.values()}
    assert len(ids) == len(where), where  # distinct
    for task_id, w in where.items():
        assert w["hostname"] == "sandbox" and "agent.py" in w["pid1"], (task_id, w)
        assert stack.seen.of(run_id, task_id) == [w["sandbox_id"]], (task_id, stack.seen.of(run_id, task_id))
        ti = stack.airflow.task_instance(dag_id, run_id, task_id)
        assert ti["state"] == "success" and ti["try_number"] == 1, ti
        assert ti["hostname"] != WORKER, ti  # the sandbox's fqdn (not the Celery worker's name)
        assert stack.seen.sandboxes[w["sandbox_id"]]["job_try"] == "1", ti
        assert not (stack.markers / task_id).exists(), f"{task_id} ran on the host"


def test_plain_tasks_and_a_celery_mix_each_try_in_its_own_sandbox(stack: ExecutorStack) -> None:
    plain = stack.trigger("e2e_executor_plain")
    mixed = stack.trigger("e2e_executor_mixed")
    for dag_id, run_id in (("e2e_executor_plain", plain), ("e2e_executor_mixed", mixed)):
        dag_run = stack.airflow.wait_run(dag_id, run_id, timeout=420)
        assert dag_run["state"] == "success", stack.airflow.task_instances(dag_id, run_id)

    # Every plain task on PandaStackExecutor: its own sandbox, never the host.
    where = reports(stack, "e2e_executor_plain", plain, ["decorated", "python_op", "bash_op"])
    assert_in_own_sandbox(stack, "e2e_executor_plain", plain, where)

    # The mix: Celery tasks on the Celery worker (markers on the host: the marker check can fail),
    # the PandaStack one in its sandbox, data flowing through XCom across both.
    got = reports(stack, "e2e_executor_mixed", mixed, ["produce", "double", "consume"])
    assert [got[t]["n"] for t in ("produce", "double", "consume")] == [21, 42, 42], got
    assert_in_own_sandbox(stack, "e2e_executor_mixed", mixed, {"double": got["double"]["where"]})
    for task_id in ("produce", "consume"):
        ti = stack.airflow.task_instance("e2e_executor_mixed", mixed, task_id)
        assert ti["hostname"] == WORKER and got[task_id]["where"]["sandbox_id"] is None, ti
        assert (stack.markers / task_id).exists(), f"{task_id} did not run on the host's worker"
        assert stack.seen.of(mixed, task_id) == []

    # Every sandbox is deleted once the executor has seen its try end.
    wait_for("the executor to delete the sandboxes", stack.live, timeout=120, check=lambda s: s == [])


def test_task_marked_failed_deletes_its_sandbox(stack: ExecutorStack) -> None:
    dag_id = "e2e_executor_hold"
    run_id = stack.trigger(dag_id)
    sandbox = wait_for(
        "held_a running in its sandbox",
        lambda: stack.live(job_run=run_id, job_task="held_a"),
        timeout=240,
        check=lambda s: (
            len(s) == 1 and stack.airflow.task_instance(dag_id, run_id, "held_a")["state"] == "running"
        ),
    )[0]
    stack.release(run_id, "held_b")
    # The UI's log view of a running try: the executor reads the sandbox's live output.
    logs = stack.airflow.request(
        "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/held_a/logs/1?full_content=true"
    )
    assert f"live output from sandbox {sandbox['id']}" in json.dumps(logs), json.dumps(logs)[-3000:]
    # As the UI does: PATCH the task instance's state.
    path = f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/held_a"
    stack.airflow.request("PATCH", path, {"new_state": "failed"})
    marked = time.monotonic()
    wait_for(
        "the killed try's sandbox to be deleted",
        lambda: {sb["id"] for sb in stack.ps.sandboxes()},
        timeout=90,
        check=lambda ids: sandbox["id"] not in ids,
    )
    gone_after = time.monotonic() - marked
    print(f"killed try's sandbox deleted {gone_after:.1f}s after the PATCH")
    dag_run = stack.airflow.wait_run(dag_id, run_id, timeout=240)
    assert dag_run["state"] == "failed", dag_run
    tries = stack.airflow.tries(dag_id, run_id, "held_a")
    assert [(t["try_number"], t["state"]) for t in tries] == [(1, "failed")], tries
    assert stack.seen.of(run_id, "held_a") == [sandbox["id"]]
    assert stack.airflow.task_instance(dag_id, run_id, "held_b")["state"] == "success"
    wait_for("no sandbox of the run", lambda: stack.live(job_run=run_id), timeout=60, check=lambda s: s == [])


def test_scheduler_sigkilled_mid_run_finishes_each_task_once(stack: ExecutorStack) -> None:
    """held_a ends while no scheduler runs (its TI is done; its sandbox has no owner); held_b is
    still running when the new scheduler comes and is adopted. Both end once, nothing is left."""
    dag_id = "e2e_executor_hold"
    run_id = stack.trigger(dag_id)
    wait_for(
        "both tasks running in their sandboxes",
        lambda: [stack.airflow.task_instance(dag_id, run_id, t)["state"] for t in ("held_a", "held_b")],
        timeout=300,
        check=lambda states: states == ["running", "running"] and len(stack.live(job_run=run_id)) == 2,
    )
    old = stack.scheduler
    old.kill_tree()  # the scheduler's machine dies
    stack.release(run_id, "held_a")
    wait_for(
        "held_a to report success without a scheduler",
        lambda: stack.airflow.task_instance(dag_id, run_id, "held_a")["state"],
        timeout=180,
        check=lambda s: s == "success",
    )
    new = stack.start_scheduler("executor-scheduler-2")
    wait_for(
        "the new scheduler to adopt held_b",
        lambda: re.search(r"PandaStackExecutor: adopted .*held_b", new.tail(2000)),
        timeout=120,
        interval=1,
    )
    stack.release(run_id, "held_b")
    dag_run = stack.airflow.wait_run(dag_id, run_id, timeout=240)
    assert dag_run["state"] == "success", stack.airflow.task_instances(dag_id, run_id)
    wait_for("no sandbox of the run", lambda: stack.live(job_run=run_id), timeout=90, check=lambda s: s == [])
    for task_id in ("held_a", "held_b"):
        tries = stack.airflow.tries(dag_id, run_id, task_id)
        assert [(t["try_number"], t["state"]) for t in tries] == [(1, "success")], tries
        assert stack.starts(run_id, task_id) == 1, task_id  # the task's code started once
        assert len(stack.seen.of(run_id, task_id)) == 1, stack.seen.of(run_id, task_id)  # one sandbox


def test_no_executor_sandbox_left(stack: ExecutorStack) -> None:
    assert stack.live() == []
