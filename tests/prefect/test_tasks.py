"""run_in_sandbox, @sandbox_task and the warm-fork pool in real flows against pandastack_local."""

from __future__ import annotations

import json
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
from prefect import flow, unmapped
from prefect.futures import wait

from pandastack_jobs import JobArgumentsError
from prefect_blocks import (
    PandaStackSandbox,
    SandboxJobFailed,
    arun_in_sandbox,
    run_in_fork,
    run_in_sandbox,
    sandbox_task,
    warm_pool,
)
from tests.support.prefect_readback import artifacts, flow_run_id, logs, task_runs

FAKE_TOKEN = "pds_" + "0123456789abcdef" * 2
REPORT_JOB = f"""
import json
rows = json.load(open("/work/input.json"))["rows"]
records = [{{"tenant": r, "total": r * 10}} for r in rows]
json.dump(records, open("/work/result.json", "w"))
open("/work/report.md", "w").write("# Daily report\\n\\n{{}} tenants\\n".format(len(rows)))
open("/work/data.csv", "w").write("tenant,total\\n" + "".join("%s,%s\\n" % (r, r * 10) for r in rows))
print("processed", len(rows), "rows")
print("leaked token {FAKE_TOKEN}")
"""


def test_success_publishes_result_report_and_file_as_artifacts(
    credentials, local_server, tmp_path, monkeypatch
):
    monkeypatch.setenv("PREFECT_INTEGRATIONS_PANDASTACK_FILES_DIR", str(tmp_path))

    @flow
    def report_flow(rows: list[int]) -> object:
        return run_in_sandbox(
            command="python3 report.py",
            files={"report.py": REPORT_JOB},
            input={"rows": rows},
            collect=["report.md", "data.csv"],
            credentials=credentials,
            timeout=60,
            artifact_key="daily-report",
        )

    state = report_flow([1, 2, 3], return_state=True)
    assert state.is_completed(), state.message
    assert state.result() == [{"tenant": r, "total": r * 10} for r in (1, 2, 3)]

    run_id = flow_run_id(state)
    by_key = {a.key: a for a in artifacts(run_id)}
    assert set(by_key) == {"daily-report-result", "daily-report-report-md", "daily-report-data-csv"}
    table = by_key["daily-report-result"]
    assert table.type == "table"
    data = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert data == [{"tenant": r, "total": r * 10} for r in (1, 2, 3)]
    report = by_key["daily-report-report-md"]
    assert report.type == "markdown"
    assert "# Daily report" in report.data and "3 tenants" in report.data
    link = by_key["daily-report-data-csv"]  # Prefect stores a link artifact as markdown "[text](url)"
    assert link.data.startswith("[data.csv](file://")
    target = Path(urlparse(str(link.data).split("](")[-1].rstrip(")")).path)
    assert target.read_text() == "tenant,total\n1,10\n2,20\n3,30\n"
    assert tmp_path in target.parents

    text = logs(run_id)
    assert "[stdout] processed 3 rows" in text
    assert "leaked token ***" in text
    assert FAKE_TOKEN not in text and local_server.api_key not in text
    for artifact in artifacts(run_id):
        assert local_server.api_key not in str(artifact.data) + str(artifact.description)


def test_nonzero_exit_is_retried_then_fails(credentials):
    @flow
    def flaky_flow() -> object:
        return run_in_sandbox.with_options(retries=2)(
            command="echo 'attempt in' $(hostname) >&2; exit 3", credentials=credentials, timeout=30
        )

    started = time.monotonic()
    state = flaky_flow(return_state=True)
    assert state.is_failed()
    runs = task_runs(flow_run_id(state))
    assert len(runs) == 1
    assert runs[0].run_count == 3  # 1 try + 2 redeliveries
    assert runs[0].state.is_failed()
    with pytest.raises(SandboxJobFailed) as info:
        state.result()
    assert info.value.redeliver and info.value.exit_code == 3
    text = logs(flow_run_id(state))
    attempts_seen = [line for line in text.splitlines() if "job running in sandbox" in line]
    assert len(attempts_seen) == 3, attempts_seen
    assert [a.rsplit("attempt ", 1)[1].rstrip(")") for a in attempts_seen] == ["1001", "1002", "1003"]
    assert time.monotonic() - started < 60


def test_permanent_exit_code_is_dead_lettered_without_retry(credentials):
    @flow
    def bad_input_flow() -> object:
        return run_in_sandbox.with_options(retries=3)(
            command="echo 'row 7: unparseable date' >&2; exit 42",
            permanent_exit_codes=[42],
            credentials=credentials,
            timeout=30,
            job_name="parse-rows",
        )

    state = bad_input_flow(return_state=True)
    assert state.is_failed()
    runs = task_runs(flow_run_id(state))
    assert [r.run_count for r in runs] == [1]
    with pytest.raises(SandboxJobFailed) as info:
        state.result()
    assert info.value.dead_letter and info.value.kind.value == "permanent_exit_code"
    dead = [a for a in artifacts(flow_run_id(state)) if a.key == f"parse-rows-dead-letter-{runs[0].id}"]
    assert len(dead) == 1
    assert "exit code 42" in dead[0].data and "row 7: unparseable date" in dead[0].data


def test_timeout_kills_the_job_and_is_redelivered_once(credentials):
    @flow
    def slow_flow() -> object:
        return run_in_sandbox.with_options(retries=1)(command="sleep 60", credentials=credentials, timeout=2)

    started = time.monotonic()
    state = slow_flow(return_state=True)
    elapsed = time.monotonic() - started
    assert state.is_failed()
    with pytest.raises(SandboxJobFailed) as info:
        state.result()
    assert info.value.kind.value == "timeout" and info.value.redeliver
    assert task_runs(flow_run_id(state))[0].run_count == 2
    assert elapsed < 40, elapsed


def test_timeout_not_retried_when_retry_on_timeout_is_off(credentials):
    block = PandaStackSandbox(credentials=credentials, timeout=1, retry_on_timeout=False)

    @flow
    def slow_flow() -> object:
        return run_in_sandbox(command="sleep 30", sandbox=block)

    state = slow_flow(return_state=True)
    assert state.is_failed()
    assert task_runs(flow_run_id(state))[0].run_count == 1


TENANT_JOB = """
import json, os, time
t = json.load(open("/work/input.json"))
if t.get("hostile") == "memory-hog":
    hog = []
    while True:
        hog.append(bytearray(16 * 1024 * 1024))
if t.get("hostile") == "fork-bomb":
    n = 0
    while True:
        try:
            pid = os.fork()
        except OSError:
            raise SystemExit("fork bomb hit the wall after %d forks" % n)
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        n += 1
json.dump({"tenant": t["name"], "score": len(t["name"])}, open("/work/result.json", "w"))
"""


@pytest.mark.parametrize("hostile", ["memory-hog", "fork-bomb"])
def test_map_over_six_tenants_only_the_hostile_one_fails(credentials, hostile):
    tenants = [{"name": f"tenant-{i}", "hostile": hostile if i == 3 else None} for i in range(6)]

    @flow
    def tenants_flow() -> list[tuple[str, str]]:
        futures = run_in_sandbox.with_options(retries=1).map(
            command=unmapped("python3 tenant.py"),
            files=unmapped({"tenant.py": TENANT_JOB}),
            input=tenants,
            credentials=unmapped(credentials),
            timeout=unmapped(60),
        )
        wait(futures)
        out = []
        for t, f in zip(tenants, futures, strict=True):
            out.append((t["name"], f.state.type.value))
        return out

    state = tenants_flow(return_state=True)
    results = dict(state.result())
    assert results == {f"tenant-{i}": ("FAILED" if i == 3 else "COMPLETED") for i in range(6)}
    runs = task_runs(flow_run_id(state))
    failed = [r for r in runs if r.state.is_failed()]
    assert len(failed) == 1 and failed[0].run_count == 2  # a crash is redelivered once, then fails
    expected = "exit code 137" if hostile == "memory-hog" else "fork bomb hit the wall"
    assert expected in (failed[0].state.message or ""), failed[0].state.message


@sandbox_task
def score(rows: list[int], weight: float = 1.0) -> dict:
    import os
    import socket

    return {
        "total": sum(rows) * weight,
        "in_sandbox": os.path.exists("/work/_pandastack_fn.py"),
        "host": socket.gethostname(),
    }


def test_sandbox_task_round_trip(credentials, monkeypatch, local_server):
    for name, value in local_server.env().items():
        monkeypatch.setenv(name, value)

    @flow
    def scoring_flow() -> dict:
        return score([1, 2, 3], weight=2.5)

    result = scoring_flow()
    assert result["total"] == 15.0 and result["in_sandbox"] is True

    @flow
    def bad_args_flow() -> dict:
        return score([object()])  # type: ignore[list-item]

    state = bad_args_flow(return_state=True)
    assert state.is_failed()
    with pytest.raises(JobArgumentsError):
        state.result()
    assert task_runs(flow_run_id(state))[0].run_count == 1  # a caller bug is never retried


def test_async_form(credentials):
    @flow
    async def async_flow() -> object:
        return await arun_in_sandbox(
            command="python3 -c \"import json; json.dump({'ok': True}, open('/work/result.json', 'w'))\"",
            credentials=credentials,
            timeout=30,
        )

    import asyncio

    assert asyncio.run(async_flow()) == {"ok": True}


WARMUP = """
import json, time
with open("/work/warm.log", "a") as f:
    f.write("warmed\\n")
json.dump({"model": "loaded"}, open("/work/result.json", "w"))
"""
FORK_JOB = """
import json
job = json.load(open("/work/input.json"))
warm_lines = open("/work/warm.log").read().splitlines()
open("/work/warm.log", "a").write("job %s\\n" % job["n"])  # must not leak into other forks
json.dump({"n": job["n"], "warm_lines": warm_lines}, open("/work/result.json", "w"))
"""


def test_warm_fork_flow_runs_warmup_once(credentials, ps_client):
    @flow
    def batch_flow() -> dict:
        with warm_pool(
            "python3 warm.py", files={"warm.py": WARMUP}, credentials=credentials, timeout=60
        ) as parent:
            futures = run_in_fork.map(
                unmapped(parent),
                command=unmapped("python3 job.py"),
                files=unmapped({"job.py": FORK_JOB}),
                input=[{"n": i} for i in range(4)],
                credentials=unmapped(credentials),
                timeout=unmapped(30),
            )
            results = [f.result() for f in futures]
            live_parent = any(sb.id == parent.parent_id for sb in ps_client.sandboxes.list())
        return {"warm": parent.warmup_result, "results": results, "parent_was_live": live_parent}

    out = batch_flow()
    assert out["warm"] == {"model": "loaded"}
    assert out["parent_was_live"]
    assert sorted(r["n"] for r in out["results"]) == [0, 1, 2, 3]
    for r in out["results"]:
        assert r["warm_lines"] == ["warmed"]  # warm-up ran once, in the parent; no job saw another's line
