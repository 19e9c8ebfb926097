"""Where the example job code lives, and the tenants' inputs.

The same as ``dags/_jobs.py`` on purpose: each engine's image gets only its own folder (the DAG
folder, or the flows' project directory), so neither can import the other's copy.
"""

from __future__ import annotations

import os
from pathlib import Path

_SAMPLE_JOBS = Path(__file__).resolve().parent.parent / "sample_jobs"
JOBS_DIR = Path(os.environ.get("PANDASTACK_EXAMPLE_JOBS", _SAMPLE_JOBS))
HOSTILE_EXIT_CODE = 3  # the escape probe exits 3 when it breached anything: dead-letter it


def tenant_files() -> dict[str, Path]:
    """``{tenant: code file}`` for every tenant transform shipped with the examples."""
    return {p.stem: p for p in sorted((JOBS_DIR / "tenants").glob("*.py"))}


def tenant_rows(tenant: str) -> list[dict[str, float]]:
    """A small deterministic input per tenant."""
    seed = sum(map(ord, tenant))
    return [{"id": i, "amount": round(5 + (seed * (i + 3)) % 240 + i / 10, 2)} for i in range(1, 21)]
