"""Daily orders report, rendered in a throwaway sandbox.

The CSV and the renderer (pandas for the aggregation, matplotlib for the chart) are
shipped into a fresh ``code-interpreter`` sandbox; the markdown report and its PNG
chart come back to object storage (``PANDASTACK_REPORTS_URL``, local ``file://`` by
default), side by side so the report's link to the chart works. XCom carries their
paths (``files``: ``{"report.md": {"path": ...}, "chart.png": {"path": ...}}``) and
the JSON summary's path (``return_value``).
"""

from __future__ import annotations

import pendulum
from _jobs import JOBS_DIR, REPORTS_URL, SANDBOX_POOL
from airflow.sdk import DAG

from airflow_provider.operators.sandbox import PandaStackSandboxOperator

# The run's date in every kind of run: a scheduled run's logical date, and for a manual or
# REST-triggered run (Airflow 3 gives those no logical date, so a bare {{ ds }} is undefined) the
# time it was triggered for.
RUN_DATE = "{{ (dag_run.logical_date or dag_run.run_after) | ds }}"

with DAG(
    dag_id="pandastack_scheduled_report",
    schedule="0 6 * * *",
    start_date=pendulum.datetime(2026, 11, 1, tz="Europe/Amsterdam"),
    catchup=False,
    tags=["pandastack", "example"],
    doc_md=__doc__,
) as dag:
    PandaStackSandboxOperator(
        task_id="render_report",
        command="python3 render_report.py",
        files={
            "render_report.py": JOBS_DIR / "report" / "render_report.py",
            "orders.csv": JOBS_DIR / "report" / "orders.csv",
        },
        input={"date": RUN_DATE},
        template="code-interpreter",
        collect=["report.md", "chart.png"],
        object_storage_path=REPORTS_URL + "/{{ dag.dag_id }}/" + RUN_DATE,
        xcom_max_bytes=0,  # report, chart and summary go to object storage; XCom holds paths
        timeout=120,
        retries=2,
        pool=SANDBOX_POOL,
    )
