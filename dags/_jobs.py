"""Where the example job code lives (the files shipped into the sandboxes).

``sample_jobs/`` sits next to ``dags/`` in this repository; set ``PANDASTACK_EXAMPLE_JOBS``
when the DAG folder is deployed elsewhere. The tenants' helpers repeat ``flows/_jobs.py`` on purpose:
an Airflow image gets only its DAG folder, a Prefect one only the flows' project, so neither can
import the other's.
"""

from __future__ import annotations

import os
from pathlib import Path

import pendulum
from airflow.sdk import DAG

_SAMPLE_JOBS = Path(__file__).resolve().parent.parent / "sample_jobs"
JOBS_DIR = Path(os.environ.get("PANDASTACK_EXAMPLE_JOBS", _SAMPLE_JOBS))
REPORTS_URL = os.environ.get("PANDASTACK_REPORTS_URL", "file:///tmp/pandastack-reports")
# An Airflow pool bounds how many sandboxes these DAGs keep alive at once:
#   airflow pools set pandastack_sandboxes 4 "live PandaStack sandboxes"
SANDBOX_POOL = os.environ.get("PANDASTACK_AIRFLOW_POOL", "pandastack_sandboxes")
HOSTILE_EXIT_CODE = 3  # the escape probe exits 3 when it breached anything: dead-letter it


def tenant_files() -> dict[str, Path]:
    """``{tenant: code file}`` for every tenant transform shipped with the examples."""
    return {p.stem: p for p in sorted((JOBS_DIR / "tenants").glob("*.py"))}


def tenant_rows(tenant: str) -> list[dict[str, float]]:
    """A small deterministic input per tenant."""
    seed = sum(map(ord, tenant))
    return [{"id": i, "amount": round(5 + (seed * (i + 3)) % 240 + i / 10, 2)} for i in range(1, 21)]


def example_dag(dag_id: str, doc_md: str | None) -> DAG:
    """An example run on demand (``airflow dags trigger``): no schedule, no catch-up."""
    return DAG(
        dag_id=dag_id,
        schedule=None,
        start_date=pendulum.datetime(2026, 11, 1, tz="UTC"),
        catchup=False,
        tags=["pandastack", "example"],
        doc_md=doc_md,
    )
