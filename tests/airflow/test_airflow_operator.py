"""PandaStackSandboxOperator in real DAGs (``dag.test()``, SQLite) against pandastack-local."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import pendulum
from airflow.sdk import DAG

from airflow_provider.operators.sandbox import PandaStackSandboxOperator
from tests.support.dagtest import all_xcom_text, connection_env, run_dag, task_instances, try_history, xcom

START = pendulum.datetime(2024, 1, 1, tz="UTC")

SUM_JOB = """
import json, os
data = json.load(open(os.environ["JOB_INPUT"]))
print("summing", len(data["rows"]), "rows")
open("/work/report.txt", "w").write("total=%d\\n" % sum(data["rows"]))
json.dump({"total": sum(data["rows"]), "tenant": data["tenant"]}, open(os.environ["JOB_RESULT"], "w"))
"""


def test_success_pushes_result_files_sandbox_id_and_timings(airflow_env, local_server, ps_client, capfd):
    with DAG("ps_success", schedule=None, start_date=START) as dag:
        PandaStackSandboxOperator(
            task_id="sum",
            # Templated: the run id reaches the job; the key must never reach XCom or rendered fields.
            command="echo run={{ run_id }} key={{ conn.pandastack_default.password }} && python3 job.py",
            files={"job.py": SUM_JOB},
            input={"rows": [1, 2, 3, 4], "tenant": "{{ dag.dag_id }}"},
            collect=["report.txt"],
            timeout=60,
        )
    dr = run_dag(dag)
    ti = task_instances(dr)[("sum", -1)]
    assert ti.state == "success" and ti.try_number == 1
    assert xcom(dr, "sum") == {"total": 10, "tenant": "ps_success"}
    sandbox_id = xcom(dr, "sum", "sandbox_id")
    assert sandbox_id
    summary = xcom(dr, "sum", "pandastack")
    assert summary["ok"] and summary["sandbox_id"] == sandbox_id and summary["try_number"] == 1
    timings = xcom(dr, "sum", "timings")
    assert timings["exec"] > 0 and timings["total"] >= timings["exec"]
    assert xcom(dr, "sum", "files") == {"/work/report.txt": {"size": 9, "text": "total=10\n"}}
    # The job's output streamed into the task log, line by line; the key is masked there.
    out = capfd.readouterr().out
    assert "[sandbox stdout] summing 4 rows" in out
    assert "[sandbox stdout] run=manual__" in out and " key=***" in out
    assert local_server.api_key not in out
    # The key never reaches XCom or the rendered template fields.
    assert local_server.api_key not in all_xcom_text(dr)
    assert ps_client.sandboxes.list() == []


def test_nonzero_exit_is_retried_in_a_fresh_sandbox_then_fails(airflow_env, local_server):
    with DAG("ps_exit", schedule=None, start_date=START) as dag:
        PandaStackSandboxOperator(
            task_id="flaky",
            command="echo boom >&2; exit 2",
            retries=1,
            retry_delay=timedelta(seconds=0),
        )
    dr = run_dag(dag)
    ti = task_instances(dr)[("flaky", -1)]
    assert ti.state == "failed"
    assert ti.try_number == 2  # tried, redelivered once, failed
    assert dr.state == "failed"


def test_permanent_exit_code_fails_at_once_without_retry(airflow_env, local_server):
    with DAG("ps_permanent", schedule=None, start_date=START) as dag:
        PandaStackSandboxOperator(
            task_id="bad_input",
            command="echo 'row 7 is not a date' >&2; exit 3",
            permanent_exit_codes=[3],
            retries=3,
            retry_delay=timedelta(seconds=0),
        )
    dr = run_dag(dag)
    ti = task_instances(dr)[("bad_input", -1)]
    assert ti.state == "failed"
    assert ti.try_number == 1  # dead-letter: the three retries were not used


def test_timeout_kills_the_job_on_time(airflow_env, local_server):
    with DAG("ps_timeout", schedule=None, start_date=START) as dag:
        PandaStackSandboxOperator(task_id="slow", command="sleep 120", timeout=2, retries=0)
        PandaStackSandboxOperator(
            task_id="slow_dead_letter",
            command="sleep 120",
            timeout=2,
            retry_on_timeout=False,
            retries=2,
            retry_delay=timedelta(seconds=0),
        )
        # Airflow's own clock (SIGALRM → AirflowTaskTimeout → on_kill) also leaves no sandbox.
        PandaStackSandboxOperator(
            task_id="airflow_timeout",
            command="sleep 120",
            timeout=300,
            execution_timeout=timedelta(seconds=2),
        )
    started = time.monotonic()
    dr = run_dag(dag)
    elapsed = time.monotonic() - started
    tis = task_instances(dr)
    assert tis[("slow", -1)].state == "failed"
    assert tis[("slow_dead_letter", -1)].state == "failed"
    assert tis[("slow_dead_letter", -1)].try_number == 1  # retry_on_timeout=False: no retry
    assert tis[("airflow_timeout", -1)].state == "failed"
    assert elapsed < 60, elapsed  # three 120 s sleeps were cut at ~2 s each


def test_mapped_tenants_only_the_hostile_one_fails(airflow_env, local_server):
    jobs = Path(__file__).resolve().parents[2] / "sample_jobs" / "tenants"
    rows = [{"id": i, "amount": float(10 * i)} for i in range(1, 8)]
    tenants = ["acme", "globex", "initech", "umbrella", "evil_memory_hog", "acme"]
    with DAG("ps_tenants", schedule=None, start_date=START) as dag:
        PandaStackSandboxOperator.partial(
            task_id="transform", command="python3 job.py", input={"rows": rows}, timeout=60, retries=0
        ).expand(files=[{"job.py": (jobs / f"{name}.py").read_text()} for name in tenants])
    dr = run_dag(dag)
    tis = task_instances(dr)
    states = {i: tis[("transform", i)].state for i in range(len(tenants))}
    assert states == {i: ("failed" if tenants[i] == "evil_memory_hog" else "success") for i in range(6)}
    assert xcom(dr, "transform", map_index=0)["tenant"] == "acme"
    assert xcom(dr, "transform", map_index=1)["tenant"] == "globex"
    hog = xcom(dr, "transform", "pandastack", map_index=4)
    assert hog["ok"] is False and hog["class"] == "redeliver"


def test_large_files_and_results_go_to_object_storage(airflow_env, local_server, tmp_path):
    big = """
import json
open("/work/big.csv", "w").write("id,value\\n" + "".join("%d,%d\\n" % (i, i * i) for i in range(20000)))
json.dump({"values": list(range(30000))}, open("/work/result.json", "w"))
"""
    with DAG("ps_storage", schedule=None, start_date=START) as dag:
        PandaStackSandboxOperator(
            task_id="big",
            command="python3 big.py",
            files={"big.py": big},
            collect=["big.csv"],
            object_storage_path=f"file://{tmp_path}",
            xcom_max_bytes=64 * 1024,
        )
    dr = run_dag(dag)
    assert task_instances(dr)[("big", -1)].state == "success"
    files = xcom(dr, "big", "files")
    entry = files["/work/big.csv"]
    assert entry["size"] > 64 * 1024 and "text" not in entry
    stored = Path(entry["path"].removeprefix("file://"))
    assert stored.is_file() and str(stored).startswith(str(tmp_path))
    assert stored.read_text().splitlines()[4] == "3,9"
    result_uri = xcom(dr, "big")
    assert isinstance(result_uri, str) and result_uri.endswith("result.json")
    assert json.loads(Path(result_uri.removeprefix("file://")).read_text()) == {"values": list(range(30000))}


def test_capacity_refusal_is_redelivered_after_the_retry_after(airflow_env, make_local_server, monkeypatch):
    server = make_local_server(max_sandboxes=1)
    for name, value in connection_env(server, "pandastack_full", create_budget=0).items():
        monkeypatch.setenv(name, value)
    holder = server.client().sandboxes.create(template="base", ttl_seconds=60)
    with DAG("ps_capacity", schedule=None, start_date=START) as dag:
        PandaStackSandboxOperator(
            task_id="crowded",
            command="echo '{\"ran\": true}' > result.json",
            pandastack_conn_id="pandastack_full",
            retries=2,
            retry_delay=timedelta(seconds=0),  # the server's Retry-After must win over this
            on_retry_callback=lambda context: holder.kill(),  # capacity frees up after the refusal
        )
    dr = run_dag(dag)
    ti = task_instances(dr)[("crowded", -1)]
    assert ti.state == "success" and ti.try_number == 2
    assert xcom(dr, "crowded") == {"ran": True}
    (first,) = try_history(dr, "crowded")
    waited = (ti.start_date - first.end_date).total_seconds()
    # The server's refusal carries Retry-After: 1 (CAPACITY_RETRY_AFTER); its header decides, not the
    # message's words (issue 36), and it wins over the task's retry_delay of 0.
    assert waited >= 0.9, waited
    assert server.client().sandboxes.list() == []
