"""``@task.pandastack``, deferrable mode and warm-fork pools in real DAGs."""

from __future__ import annotations

import asyncio
import datetime as dt
from pathlib import Path

import pendulum
import pytest
from airflow.sdk import DAG, task

from airflow_provider.operators.sandbox import PandaStackSandboxOperator
from airflow_provider.operators.warm_fork import (
    PandaStackForkOperator,
    PandaStackWarmPoolSetupOperator,
    PandaStackWarmPoolTeardownOperator,
)
from pandastack_jobs import JobSpec, start_detached
from tests.support.dagtest import run_dag, task_instances, xcom

START = pendulum.datetime(2024, 1, 1, tz="UTC")
JOBS = Path(__file__).resolve().parents[2] / "sample_jobs"


def summarise(rows: list, scale: int = 1) -> dict:
    import os
    import statistics

    return {
        "n": len(rows),
        "mean": statistics.mean(rows) * scale,
        "in_sandbox": os.path.exists("/work/input.json"),
    }


def test_task_pandastack_round_trip_is_json_only(airflow_env, local_server):
    with DAG("ps_taskflow", schedule=None, start_date=START) as dag:

        @task
        def rows() -> list:
            return [2, 4, 6]

        @task.pandastack(timeout=60)
        def stats(rows: list, scale: int = 1) -> dict:
            return summarise(rows, scale)

        @task.pandastack(timeout=60)
        def stats_ok(rows: list, scale: int = 1) -> dict:
            import os
            import statistics

            return {"n": len(rows), "mean": statistics.mean(rows) * scale, "sandbox": os.path.isdir("/work")}

        @task.pandastack(timeout=60, retries=2)
        def no_pickles(value: object) -> None:
            return None

        @task.pandastack(timeout=60, deferrable=True, poll_interval=0.5)
        def stats_deferred(rows: list) -> dict:
            return {"max": max(rows)}

        @task
        def check(result: dict) -> dict:
            assert result == {"n": 3, "mean": 40, "sandbox": True}
            return result

        data = rows()
        stats(data, scale=10)
        check(stats_ok(data, scale=10))
        stats_deferred(data)
        no_pickles(dt.date(2024, 1, 1))

    dr = run_dag(dag)
    tis = task_instances(dr)
    assert tis[("stats_ok", -1)].state == "success"
    assert xcom(dr, "stats_ok") == {"n": 3, "mean": 40, "sandbox": True}
    assert tis[("check", -1)].state == "success"
    assert xcom(dr, "stats_deferred") == {"max": 6}  # the decorator in deferrable mode
    # The function runs in the sandbox, not here: a DAG-file global is not there.
    assert tis[("stats", -1)].state == "failed"
    assert "NameError" in xcom(dr, "stats", "pandastack")["reason"]
    # A non-JSON argument is refused before any sandbox exists, with no retry: nothing is pickled.
    assert tis[("no_pickles", -1)].state == "failed"
    assert tis[("no_pickles", -1)].try_number == 1


def test_deferrable_run_completes_through_the_trigger(airflow_env, local_server, capfd):
    job = (
        "import json, time; time.sleep(3); print('deferred job done'); "
        "json.dump({'ok': True}, open('/work/result.json', 'w'))"
    )
    with DAG("ps_deferrable", schedule=None, start_date=START) as dag:
        PandaStackSandboxOperator(
            task_id="slow", command=f'python3 -c "{job}"', deferrable=True, poll_interval=0.5, timeout=60
        )
    dr = run_dag(dag)
    ti = task_instances(dr)[("slow", -1)]
    assert ti.state == "success"
    assert xcom(dr, "slow") == {"ok": True}
    assert xcom(dr, "slow", "pandastack")["ok"] is True
    out = capfd.readouterr().out
    assert "deferring" in out and "trigger reported exited" in out
    assert "deferred job done" in out  # the job's output reached the task log


def test_trigger_on_kill_deletes_the_sandbox(airflow_env, local_server, ps_client):
    from airflow_provider.triggers.sandbox import PandaStackJobTrigger

    started = start_detached(ps_client, JobSpec(command="sleep 60", timeout=90))
    assert not hasattr(started, "ok"), started
    trigger = PandaStackJobTrigger(job=started.to_dict(), poll_interval=0.2)
    classpath, kwargs = trigger.serialize()
    assert classpath == "airflow_provider.triggers.sandbox.PandaStackJobTrigger"
    trigger = PandaStackJobTrigger(**kwargs)

    async def killed_while_running() -> None:
        run = asyncio.ensure_future(trigger.run().__anext__())
        await asyncio.sleep(1.0)
        assert not run.done()  # still polling: the job runs
        run.cancel()
        await trigger.on_kill()

    asyncio.run(killed_while_running())
    assert ps_client.sandboxes.list() == []


def test_warm_fork_pool_warms_once_and_tears_down_even_when_a_job_fails(airflow_env, local_server):
    with DAG("ps_warm", schedule=None, start_date=START) as dag:
        warm = PandaStackWarmPoolSetupOperator(
            task_id="warm",
            command="python3 warmup.py",
            files={"warmup.py": (JOBS / "warm" / "warmup.py").read_text()},
            timeout=60,
        )
        score = PandaStackForkOperator.partial(
            task_id="score",
            parent_id=warm.output,
            command="python3 score.py",
            files={"score.py": (JOBS / "warm" / "score.py").read_text()},
            timeout=60,
            retries=0,
        ).expand(input=[{"id": 1}, {"id": 2}, {"id": "not-a-number"}, {"id": 4}])
        cool = PandaStackWarmPoolTeardownOperator(task_id="cool", parent_id=warm.output)
        warm >> score >> cool.as_teardown(setups=warm)

    dr = run_dag(dag)
    tis = task_instances(dr)
    assert tis[("warm", -1)].state == "success" and tis[("warm", -1)].try_number == 1
    assert [tis[("score", i)].state for i in range(4)] == ["success", "success", "failed", "success"]
    assert tis[("cool", -1)].state == "success"  # teardown ran although a job failed
    built_at = xcom(dr, "warm", "warmup")["built_at"]
    parent_id = xcom(dr, "warm")
    for i in (0, 1, 3):
        assert xcom(dr, "score", map_index=i)["model_built_at"] == built_at  # one warm-up, shared
        assert xcom(dr, "score", "sandbox_id", map_index=i) != parent_id  # each job in its own fork
    # No parent and no fork is left (the shared guard checks the server after the test too).
    assert local_server.client().sandboxes.list() == []


@pytest.mark.parametrize("bad", [{"deferrable": True}])
def test_fork_operator_refuses_deferrable(bad):
    with pytest.raises(ValueError, match="deferrable"):
        PandaStackForkOperator(task_id="x", parent_id="p", command="true", **bad)


def test_trigger_reports_a_vanished_sandbox(airflow_env, local_server, ps_client):
    from airflow_provider.triggers.sandbox import PandaStackJobTrigger

    started = start_detached(ps_client, JobSpec(command="sleep 60", timeout=90))
    ps_client.sandboxes.delete(started.sandbox_id)  # reaped, crashed, or the server restarted

    async def first_event():
        return await PandaStackJobTrigger(job=started.to_dict(), poll_interval=0.2).run().__anext__()

    event = asyncio.run(first_event())
    assert event.payload["status"] == "gone"
    assert event.payload["job"]["sandbox_id"] == started.sandbox_id


def test_job_output_reaches_the_log_line_by_line():
    from airflow_provider.operators.sandbox import task_log_lines

    lines: list[tuple[str, str]] = []

    class Log:
        def info(self, fmt: str, line: str) -> None:
            lines.append(("info", line))

        def warning(self, fmt: str, line: str) -> None:
            lines.append(("warning", line))

    stream = task_log_lines(Log())
    stream("stdout", "hel")
    stream("stderr", "oops\n")
    stream("stdout", "lo\nwor")
    assert lines == [("warning", "oops"), ("info", "hello")]
    stream.flush()
    assert lines[-1] == ("info", "wor")
