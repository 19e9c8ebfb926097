"""Issue 25 (items 4 and 9) in real DAG runs: the README's operator example as pasted and the
scheduled-report example DAG, in a manual run (Airflow 3: no logical date), a template error that
must not burn retries, and the ``files`` XCom that is there even when nothing was collected."""

from __future__ import annotations

import json
import runpy
import sys
from datetime import timedelta
from pathlib import Path

import pendulum
from airflow.sdk import DAG

from airflow_provider.templating import RUN_DATE_HINT
from tests.docs.snippets import ROOT, snippet_containing
from tests.support.dagtest import run_dag, task_instances, xcom

START = pendulum.datetime(2024, 1, 1, tz="UTC")
TENANT_CODE = """
import json
data = json.load(open("/work/input.json"))
json.dump({"n": len(data["rows"]), "day": data["day"]}, open("/work/result.json", "w"))
"""


def test_readme_operator_example_runs_in_a_manual_run(airflow_env, local_server, ps_client):
    snippet = snippet_containing("permanent_exit_codes=[3], pool=")
    with DAG("newcomer_readme", schedule="@daily", start_date=START, catchup=False) as dag:
        scope = {"tenant_code": TENANT_CODE, "rows": [1, 2, 3]}
        exec(compile(snippet.text, str(snippet), "exec"), scope)
    dag.task_dict["transform"].pool = "default_pool"  # the README's pool is created by a CLI step
    dr = run_dag(dag, logical_date=None)  # a manual / REST-triggered run: no logical date
    ti = task_instances(dr)[("transform", -1)]
    assert ti.state == "success", ti.state
    assert xcom(dr, "transform") == {"n": 3, "day": dr.run_after.strftime("%Y-%m-%d")}
    assert xcom(dr, "transform", "files") == {}  # pushed even though nothing was collected
    assert ps_client.sandboxes.list() == []


def test_airflow_guide_dag_runs_as_pasted(airflow_env, local_server, ps_client, tmp_path: Path):
    # The guide's whole DAG file, as a newcomer saves it (a real file: @task.pandastack ships source).
    snippet = snippet_containing('with DAG("tenant_transforms"', doc=ROOT / "docs" / "airflow.md")
    (tmp_path / "guide_dag.py").write_text(snippet.text)
    dag = runpy.run_path(str(tmp_path / "guide_dag.py"))["dag"]
    dag.task_dict["transform"].pool = "default_pool"  # the guide's pool is created by a CLI step
    dr = run_dag(dag, logical_date=None)
    states = {k[0]: ti.state for k, ti in task_instances(dr).items()}
    assert states == {"transform": "success", "stats": "success"}, states
    assert xcom(dr, "transform")["total"] == 8
    assert xcom(dr, "stats") == {"mean": 4}
    assert ps_client.sandboxes.list() == []


def test_scheduled_report_dag_renders_in_a_manual_run(
    airflow_env, local_server, ps_client, tmp_path, monkeypatch
):
    """dags/scheduled_report.py triggered by hand or through the REST API (no logical date): its
    templated input and object-storage path render to the run's date, and the report lands there."""
    monkeypatch.setenv("PANDASTACK_REPORTS_URL", f"file://{tmp_path}")
    monkeypatch.setenv("PANDASTACK_AIRFLOW_POOL", "default_pool")  # the DAG's pool is made by a CLI step
    monkeypatch.syspath_prepend(str(ROOT / "dags"))
    monkeypatch.delitem(sys.modules, "_jobs", raising=False)  # re-read the environment above
    dag = runpy.run_path(str(ROOT / "dags" / "scheduled_report.py"))["dag"]
    dr = run_dag(dag, logical_date=None)
    ti = task_instances(dr)[("render_report", -1)]
    assert ti.state == "success" and ti.try_number == 1, (ti.state, ti.try_number)
    day = dr.run_after.strftime("%Y-%m-%d")
    url = xcom(dr, "render_report", "files")["/work/report.md"]["path"]
    assert url.startswith(f"file://{tmp_path}/pandastack_scheduled_report/{day}/"), url
    assert Path(url.removeprefix("file://")).read_text().startswith(f"# Orders report for {day}")
    summary = json.loads(Path(xcom(dr, "render_report").removeprefix("file://")).read_text())
    assert summary["date"] == day
    assert ps_client.sandboxes.list() == []


def test_template_error_fails_once_with_the_fix(airflow_env, local_server, ps_client, capfd):
    from airflow_provider.operators.sandbox import PandaStackSandboxOperator

    with DAG("newcomer_template_error", schedule=None, start_date=START) as dag:
        PandaStackSandboxOperator(
            task_id="t",
            command="true",
            input={"day": "{{ ds }}"},
            retries=3,
            result_path=None,
            retry_delay=timedelta(seconds=1),
        )
    dr = run_dag(dag, logical_date=None)
    ti = task_instances(dr)[("t", -1)]
    # Not up_for_retry: no retry can render it. Nothing was created.
    assert ti.state == "failed" and ti.try_number == 1, (ti.state, ti.try_number)
    out = capfd.readouterr().out
    assert "'ds' is undefined" in out and RUN_DATE_HINT in out and "not retried" in out
    assert ps_client.sandboxes.list() == []


DEFAULTS_DAG = """
import pendulum
from airflow.sdk import DAG
from airflow_provider.operators.sandbox import PandaStackSandboxOperator

with DAG("newcomer_defaults", schedule=None, start_date=pendulum.datetime(2024, 1, 1, tz="UTC")):
    PandaStackSandboxOperator(task_id="hello", command="echo hello", result_path=None, timeout=60)
"""


def test_airflow_defaults_log_no_error(airflow_env, local_server, tmp_path: Path):
    """Airflow's own defaults (load_examples=True, no AIRFLOW__ settings): no ERROR line in a
    command's output or a task's log (the provider's example-DAG discovery used to log one)."""
    import os
    import subprocess

    from tests.support.dagtest import AIRFLOW_BIN, connection_env

    home = tmp_path / "home"
    (home / "dags").mkdir(parents=True)
    (home / "dags" / "newcomer_defaults.py").write_text(DEFAULTS_DAG)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW__", "AIRFLOW_CONN_"))}
    env.update(AIRFLOW_HOME=str(home), **connection_env(local_server))
    out = ""
    for args in (["db", "migrate"], ["dags", "reserialize"], ["dags", "test", "newcomer_defaults"]):
        proc = subprocess.run([AIRFLOW_BIN, *args], env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        out += proc.stdout + proc.stderr
    assert "load_examples = True" in (home / "airflow.cfg").read_text()  # the defaults really held
    assert "[sandbox stdout] hello" in out
    # Airflow's own example DAGs warn (with a traceback) about the kubernetes package: not ours.
    errors = [line for line in out.splitlines() if "[error" in line or "No module named 'pandastack" in line]
    assert not errors, "\n".join(errors[:20])
