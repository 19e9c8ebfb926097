"""The example flows, run exactly as ``make demo`` runs them, checked.

The hostile tenants must fail alone with the documented reasons; everything
else must succeed; the report must come back as an artifact; no sandbox may remain.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest
from prefect.client.orchestration import get_client

from demo.expectations import chart_problem, surprises
from demo.prefect_runner import run_flow


@pytest.fixture(autouse=True)
def pandastack_env(local_server: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    for name, value in local_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PREFECT_INTEGRATIONS_PANDASTACK_FILES_DIR", str(tmp_path / "files"))
    monkeypatch.setenv("PANDASTACK_DEMO_REPORTS", str(tmp_path / "reports"))


async def _artifacts(prefix: str) -> list[Any]:
    async with get_client() as client:
        found = await client.read_artifacts()
    return [a for a in found if (a.key or "").startswith(prefix)]


def test_scheduled_report_flow_publishes_the_report_artifact(tmp_path: Any) -> None:
    rows = run_flow("scheduled_report")
    assert not surprises(rows), rows
    assert rows[0]["outcome"] == "success" and "total revenue" in rows[0]["reason"]
    copied = tmp_path / "reports" / "report.md"  # the demo's copy, read back through the API
    assert str(copied) in rows[0]["reason"] and copied.read_text().startswith("# Orders report for ")
    import asyncio

    artifacts = asyncio.run(_artifacts("orders-report"))
    reports = [a for a in artifacts if a.type == "markdown" and "# Orders report for " in str(a.data)]
    assert reports, [(a.key, a.type) for a in artifacts]
    assert "| north |" in reports[0].data
    # The chart (matplotlib in the sandbox) is embedded, so the Prefect UI shows it.
    embedded = re.search(
        r"!\[Revenue by region\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", reports[0].data
    )
    assert embedded, reports[0].data[:500]
    assert chart_problem(base64.b64decode(embedded.group(1))) is None
    # The per-region numbers (pandas) are a table artifact; the PNG is also stored as a link.
    [table] = [a for a in artifacts if a.key == "orders-report-regions"]
    rows_table = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert {r["region"] for r in rows_table} >= {"north", "east"}
    assert sum(r["orders"] for r in rows_table) == 200
    [link] = [a for a in artifacts if a.key == "orders-report-chart-png"]
    stored = re.fullmatch(r"\[chart\.png\]\(file://(/.+/chart\.png)\)", str(link.data))
    assert stored and stored.group(1).startswith(str(tmp_path / "files")), link.data
    assert chart_problem(Path(stored.group(1)).read_bytes()) is None


def test_tenant_transforms_flow_fails_only_the_hostile_tenants() -> None:
    rows = run_flow("tenant_transforms")
    assert not surprises(rows), rows
    by_job = {r["job"].split("/")[-1]: r for r in rows if "/" in r["job"]}
    assert [r["job"] for r in rows if "/" not in r["job"]] == ["pandastack-tenant-transforms"]
    assert set(by_job) == {
        "acme",
        "globex",
        "initech",
        "umbrella",
        "evil_escape",
        "evil_fork_bomb",
        "evil_memory_hog",
    }
    # Killed at its memory wall (137), or by the clock when a sibling fork bomb slows it down:
    # either way it is redelivered, then fails alone.
    hog = by_job["evil_memory_hog"]["reason"]
    assert ("exit code 137" in hog or "timeout" in hog) and "redeliver" in hog, hog
    assert "[timeout, redeliver]" in by_job["evil_fork_bomb"]["reason"]
    assert (
        by_job["evil_escape"]["outcome"] == "success" and "breaches: none" in by_job["evil_escape"]["reason"]
    )


def test_warm_fork_batch_flow_warms_once() -> None:
    rows = run_flow("warm_fork_batch")
    assert rows == [rows[0]] and rows[0]["outcome"] == "success"
    assert rows[0]["reason"] == "6 forks, warm-up ran 1 time(s)"
