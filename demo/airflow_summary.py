"""Print the latest run of a DAG as demo rows (JSON). Runs in the Airflow environment.

Usage: ``python -m demo.airflow_summary DAG_ID`` with ``AIRFLOW_HOME`` set.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def rows_for(dag_id: str) -> list[dict[str, Any]]:
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        run = session.scalars(
            select(DagRun).where(DagRun.dag_id == dag_id).order_by(DagRun.run_after.desc()).limit(1)
        ).first()
        if run is None:
            raise SystemExit(f"no run of {dag_id} found")
        tis = session.scalars(
            select(TaskInstance).where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run.run_id)
        ).all()
        rows = []

        def xcom(ti: Any, key: str) -> Any:
            value = session.scalars(
                select(XComModel.value).where(
                    XComModel.dag_id == dag_id,
                    XComModel.run_id == run.run_id,
                    XComModel.task_id == ti.task_id,
                    XComModel.map_index == ti.map_index,
                    XComModel.key == key,
                )
            ).first()
            return value  # the JSON column is already decoded

        for ti in sorted(tis, key=lambda t: (t.start_date or run.run_after, t.map_index)):
            summary = xcom(ti, "pandastack")
            label = ti.rendered_map_index or (str(ti.map_index) if ti.map_index >= 0 else "")
            job = f"{dag_id}.{ti.task_id}" + (f"[{label}]" if label else "")
            summary = summary or {}
            reason = summary.get("reason") or ""
            if summary.get("class"):
                reason = f"[{summary.get('kind')}, {summary['class']}] {reason}"
            state = str(getattr(ti.state, "value", ti.state))
            rows.append(
                {
                    "engine": "airflow",
                    "job": job,
                    "outcome": state,
                    "reason": f"{reason} (tries: {ti.try_number})" if reason else f"tries: {ti.try_number}",
                    "seconds": float(ti.duration or 0.0),
                    "result": xcom(ti, "return_value"),
                    "files": xcom(ti, "files"),
                }
            )
        return rows


if __name__ == "__main__":
    print(json.dumps(rows_for(sys.argv[1])))
