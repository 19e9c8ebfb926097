"""Daily orders report, rendered in a throwaway sandbox, published as Prefect artifacts.

The renderer (pandas + matplotlib on the ``code-interpreter`` template) embeds its chart
in the markdown report as a data URI, so the ``orders-report`` markdown artifact shows it
in the Prefect UI; the PNG itself is a link artifact, and the per-region numbers a table
artifact.

Run once: ``python flows/scheduled_report.py``. Serve on a schedule (a deployment
with a cron, Europe/Amsterdam): ``python flows/scheduled_report.py --serve``.
"""

from __future__ import annotations

import sys
from datetime import date

from _jobs import JOBS_DIR
from prefect import flow
from prefect.artifacts import create_table_artifact

from prefect_blocks import run_in_sandbox


@flow(name="pandastack-scheduled-report", log_prints=True)
def scheduled_report(report_date: str | None = None) -> dict:
    """Render the report for ``report_date`` (today by default); returns the JSON summary."""
    day = report_date or date.today().isoformat()
    summary = run_in_sandbox(
        "python3 render_report.py",
        files={
            "render_report.py": JOBS_DIR / "report" / "render_report.py",
            "orders.csv": JOBS_DIR / "report" / "orders.csv",
        },
        input={"date": day, "embed_chart": True},
        template="code-interpreter",
        collect=["report.md", "chart.png"],
        timeout=120,
        job_name="render-report",
        artifact_key="orders-report",
    )
    create_table_artifact(
        summary["regions"],
        key="orders-report-regions",
        description=f"Orders and revenue by region for {day} (total {summary['total_revenue']}).",
    )
    print(f"report for {day}: total revenue {summary['total_revenue']} over {summary['orders']} orders")
    return summary


if __name__ == "__main__":
    if "--serve" in sys.argv:
        from prefect.schedules import Cron

        scheduled_report.serve(
            name="daily-orders-report",
            schedules=[Cron("0 6 * * *", timezone="Europe/Amsterdam")],
            tags=["pandastack", "example"],
        )
    else:
        scheduled_report()
