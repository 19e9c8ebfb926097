"""The example DAGs, run exactly as ``make demo`` runs them (``airflow dags test``), checked.

Each DAG runs in its own AIRFLOW_HOME (SQLite) against the shared local server.
The hostile tenants must fail alone, with the documented reasons; everything
else must succeed, and no sandbox may remain.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from demo.airflow_runner import airflow_env, prepare, run_dag
from demo.expectations import chart_problem, surprises


@pytest.fixture(scope="module")
def example_env(tmp_path_factory: pytest.TempPathFactory, local_server: Any) -> dict[str, str]:
    root = tmp_path_factory.mktemp("examples-airflow")
    env = airflow_env(root / "home", local_server.url, local_server.api_key, f"file://{root}/reports")
    env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{root}/home/airflow.db"
    env["PANDASTACK_TEST_AIRFLOW_HOME"] = str(root / "home")
    prepare(env)
    env["_REPORTS"] = str(root / "reports")
    return env


def _by_job(rows: list) -> dict[str, Any]:
    return {row["job"]: row for row in rows}


# Each runs a shipped DAG whole with `airflow dags test` (a CPU-bound start-up of Airflow, then
# several sandboxes): 170-207 s on a loaded two-core host, so the default 300 s limit is too near.
@pytest.mark.timeout(900)
def test_scheduled_report_publishes_the_report(example_env: dict[str, str], tmp_path: Path) -> None:
    rows = run_dag("pandastack_scheduled_report", example_env, tmp_path / "log")
    assert not surprises(rows), rows
    assert _by_job(rows)["pandastack_scheduled_report.render_report"]["outcome"] == "success"
    reports = list(Path(example_env["_REPORTS"]).rglob("report.md"))
    assert len(reports) == 1, (rows, (tmp_path / "log").read_text()[-3000:])
    text = reports[0].read_text()
    assert text.startswith("# Orders report for ") and "| north |" in text
    # pandas aggregated, matplotlib drew: the chart sits beside the report, which links it.
    assert "![Revenue by region](chart.png)" in text
    chart = reports[0].with_name("chart.png")
    assert chart_problem(chart.read_bytes()) is None
    # XCom carries the paths, not the bytes.
    row = _by_job(rows)["pandastack_scheduled_report.render_report"]
    files = row["files"]
    assert set(files) == {"/work/report.md", "/work/chart.png"}, files
    assert files["/work/chart.png"]["path"] == f"file://{chart}" and "base64" not in files["/work/chart.png"]
    assert files["/work/report.md"]["path"] == f"file://{reports[0]}"
    summary = json.loads(Path(row["result"].removeprefix("file://")).read_text())
    north = next(r for r in summary["regions"] if r["region"] == "north")
    assert summary["orders"] == 200 and north["orders"] > 0 and north["average"] > 0


@pytest.mark.timeout(900)
def test_tenant_transforms_fail_only_the_hostile_tenants(example_env: dict[str, str], tmp_path: Path) -> None:
    rows = run_dag("pandastack_tenant_transforms", example_env, tmp_path / "log")
    by_job = _by_job(rows)
    assert not surprises(rows), json.dumps(rows, indent=1)
    hog = by_job["pandastack_tenant_transforms.transform[evil_memory_hog]"]
    bomb = by_job["pandastack_tenant_transforms.transform[evil_fork_bomb]"]
    assert hog["outcome"] == "failed" and "tries: 2" in hog["reason"], hog
    assert "[exit_code, redeliver] job failed with exit code 137" in hog["reason"], hog
    assert (
        bomb["outcome"] == "failed"
        and "[timeout, redeliver]" in bomb["reason"]
        and "tries: 2" in bomb["reason"]
    )
    honest = [r for j, r in by_job.items() if "transform[" in j and "evil_" not in j]
    assert len(honest) == 4 and all(r["outcome"] == "success" for r in honest)
    escape = by_job["pandastack_tenant_transforms.transform[evil_escape]"]
    assert escape["outcome"] == "success" and escape["result"]["breaches"] == []  # every probe hit a wall
    assert len(escape["result"]["probes"]) >= 10
    assert by_job["pandastack_tenant_transforms.summarize"]["outcome"] == "success"


@pytest.mark.timeout(900)
def test_warm_fork_batch_warms_once(example_env: dict[str, str], tmp_path: Path) -> None:
    rows = run_dag("pandastack_warm_fork_batch", example_env, tmp_path / "log")
    assert not surprises(rows), rows
    jobs = _by_job(rows)
    assert jobs["pandastack_warm_fork_batch.warm_up"]["outcome"] == "success"
    assert sum(1 for j in jobs if j.startswith("pandastack_warm_fork_batch.score")) == 6
    assert jobs["pandastack_warm_fork_batch.cool_down"]["outcome"] == "success"
    scores = [r["result"] for j, r in jobs.items() if j.startswith("pandastack_warm_fork_batch.score")]
    assert {s["id"] for s in scores} == {1, 2, 3, 4, 5, 6}
    assert len({s["model_built_at"] for s in scores}) == 1  # one warm-up served every fork
