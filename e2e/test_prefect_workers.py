"""Prefect 3.9: a server on PostgreSQL, a ``process`` work pool, two workers, deployments
of the examples and of an e2e-only slow job, against the local PandaStack server."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from pandastack_local.testing.procs import descendants, read_proc
from pandastack_local.testing.waiting import wait_for

from .browser import chromium
from .prefect_stack import BLOCK_NAME, WORKERS, PrefectStack, start_prefect
from .procs import ProcessGroup
from .queue_checks import DEFAULTS, Stream, results_by_id
from .services import PandaStack, Postgres, Redis
from .ui_checks import prefect_credentials_block, prefect_report_artifact

pytestmark = pytest.mark.timeout(600)

HONEST = ("acme", "globex", "initech", "umbrella")


@pytest.fixture(scope="module")
def prefect(group: ProcessGroup, postgres: Postgres, pandastack: PandaStack) -> Iterator[PrefectStack]:
    with group.stopping("prefect-"):
        yield start_prefect(group, postgres, pandastack)


def prefect_sandboxes(ps: PandaStack, **match: str) -> list[dict]:
    return ps.engine_sandboxes("prefect", **match)


def flow_run_pid_owner(stack: PrefectStack, flow_run_id: str) -> str | None:
    """Which worker's process tree runs ``flow_run_id`` (from the flow-run process's environment)."""
    for name, proc in stack.workers.items():
        if not proc.alive():
            continue
        marker = f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode()
        if any(marker in (read_proc(pid, "environ") or b"") for pid in descendants(proc.pid)):
            return name
    return None


def test_two_workers_online(prefect: PrefectStack) -> None:
    assert set(WORKERS) <= set(prefect.online_workers())


def test_tenant_transforms_flow(prefect: PrefectStack, pandastack: PandaStack) -> None:
    fr_id = prefect.run_deployment("pandastack-tenant-transforms", "tenant-transforms")
    fr = prefect.wait_flow_run(fr_id, timeout=300)
    assert fr["state_type"] == "COMPLETED", fr["state"]
    report = prefect.result(fr_id)
    for tenant in HONEST:
        assert report[tenant]["ok"] is True, report[tenant]
    for tenant in ("evil_memory_hog", "evil_fork_bomb"):
        assert report[tenant]["ok"] is False and report[tenant]["reason"], report[tenant]
    assert prefect_sandboxes(pandastack, job_run=fr_id) == []


def test_scheduled_report_flow(prefect: PrefectStack, pandastack: PandaStack) -> None:
    fr_id = prefect.run_deployment("pandastack-scheduled-report", "daily-orders-report")
    fr = prefect.wait_flow_run(fr_id, timeout=300)
    assert fr["state_type"] == "COMPLETED", fr["state"]
    summary = prefect.result(fr_id)
    assert summary, summary
    assert prefect.artifacts(fr_id), "the report published no artifact"
    assert prefect_sandboxes(pandastack, job_run=fr_id) == []


def test_block_and_report_artifact_in_the_browser(prefect: PrefectStack, pandastack: PandaStack) -> None:
    """The Prefect UI's page of the saved credentials block and of the report's markdown artifact
    (docs/img/prefect-*.png); the report comes from test_scheduled_report_flow's run."""
    slug = "pandastack-credentials"
    block = prefect.request("GET", f"/block_types/slug/{slug}/block_documents/name/{BLOCK_NAME}")
    reports = prefect.request(
        "POST",
        "/artifacts/filter",
        {"artifacts": {"key": {"any_": ["orders-report-report-md"]}}, "sort": "CREATED_DESC", "limit": 1},
    )
    assert reports, "no report artifact: did test_scheduled_report_flow run?"
    with chromium(prefect.group.run_dir) as driver:
        prefect_credentials_block(driver, prefect.ui, block["id"], pandastack.api_key)
        prefect_report_artifact(driver, prefect.ui, reports[0]["id"])


def test_worker_killed_mid_job_reruns_on_the_other_worker(
    prefect: PrefectStack, pandastack: PandaStack
) -> None:
    fr_id = prefect.run_deployment("e2e-sandbox-job", "e2e", {"seconds": 20, "value": 21})
    orphan = wait_for(
        "the first attempt's sandbox",
        lambda: prefect_sandboxes(pandastack, job_run=fr_id),
        timeout=180,
        interval=0.5,
    )
    assert len(orphan) == 1, orphan
    orphan_id = orphan[0]["id"]
    victim = wait_for(
        "the worker running the flow run",
        lambda: flow_run_pid_owner(prefect, fr_id),
        timeout=30,
        interval=0.5,
    )
    survivor = next(w for w in WORKERS if w != victim)
    time.sleep(3)  # the job is sleeping inside the sandbox

    # The machine dies: SIGKILL the worker and every process under it (the flow-run process too).
    prefect.workers[victim].kill_tree()
    assert prefect.flow_run(fr_id)["state_type"] == "RUNNING"
    assert orphan_id in {sb["id"] for sb in pandastack.sandboxes()}, "the kill alone removed the sandbox"

    # What a zombie-detection automation does (docs/deploying.md): mark the run crashed, then
    # reschedule it; the surviving worker picks it up as attempt 2 of the same flow run.
    prefect.set_state(fr_id, "CRASHED")
    prefect.set_state(fr_id, "SCHEDULED", name="AwaitingRetry")
    seen_owner = wait_for(
        "the rerun to start on the surviving worker",
        lambda: flow_run_pid_owner(prefect, fr_id),
        timeout=120,
        interval=0.5,
    )
    assert seen_owner == survivor
    fr = prefect.wait_flow_run(fr_id, timeout=240)
    assert fr["state_type"] == "COMPLETED", fr["state"]
    assert fr["run_count"] >= 2, fr
    # The orphan was reaped by the rerun (its TTL, 180 s, had not run out), the result came once.
    assert orphan_id not in {sb["id"] for sb in pandastack.sandboxes()}
    assert prefect.result(fr_id) == {"value": 42, "slept": 20}
    completed = [t for t in prefect.task_runs(fr_id) if t.get("state_type") == "COMPLETED"]
    assert len(completed) == 1, [(t["name"], t["state_type"]) for t in prefect.task_runs(fr_id)]
    assert prefect_sandboxes(pandastack, job_run=fr_id) == []


def test_cancelled_flow_run_leaves_no_sandbox(prefect: PrefectStack, pandastack: PandaStack) -> None:
    fr_id = prefect.run_deployment("e2e-sandbox-job", "e2e", {"seconds": 90, "value": 1})
    wait_for(
        "the job's sandbox", lambda: prefect_sandboxes(pandastack, job_run=fr_id), timeout=180, interval=0.5
    )
    time.sleep(2)
    prefect.set_state(fr_id, "CANCELLING", force=False)
    fr = prefect.wait_flow_run(fr_id, timeout=120)
    assert fr["state_type"] == "CANCELLED", fr["state"]
    wait_for(
        "the cancelled run's sandboxes to be gone",
        lambda: prefect_sandboxes(pandastack, job_run=fr_id),
        timeout=30,
        interval=0.5,
        check=lambda sbs: sbs == [],
    )


def test_queue_deployment_acks_after_task_runs_and_redelivers_a_failed_one(
    prefect: PrefectStack, pandastack: PandaStack, redis: Redis
) -> None:
    """flows/queue_worker.py's consume_queue as a deployment run by a process worker, on a real
    Redis stream: each message a task run; ``flaky``'s first task run fails, its message is
    released and redelivered, and the second task run completes and is acked; ``poison`` is
    dead-lettered."""
    stream = Stream.fresh(redis, "e2e-prefect")
    stream.send_scenario()
    params = {
        "broker": stream.url,
        "concurrency": 3,
        "max_messages": 20,
        "idle_seconds": 3,
        "lease_seconds": 10,
        "max_deliveries": 3,
        "release_delay": 0.5,
        "defaults": DEFAULTS,
    }
    fr_id = prefect.run_deployment("pandastack-queue-consumer", "queue-worker", params)
    fr = prefect.wait_flow_run(fr_id, timeout=240)
    assert fr["state_type"] == "COMPLETED", fr["state"]
    summary = prefect.result(fr_id)
    assert (summary["received"], summary["acked"], summary["redelivered"], summary["dead_lettered"]) == (
        4,
        2,
        1,
        1,
    ), summary
    runs = sorted((t["name"], t["state_type"]) for t in prefect.task_runs(fr_id))
    assert runs == [
        ("message flaky #1", "FAILED"),
        ("message flaky #2", "COMPLETED"),
        ("message good #1", "COMPLETED"),
        ("message poison #1", "FAILED"),
    ], runs
    # Each message's result delivered once; the poison message dead-lettered with its reason.
    assert results_by_id(stream) == {
        "good": [{"id": "good", "delivery": 1}],
        "flaky": [{"id": "flaky", "delivery": 2}],
    }
    (dead,) = stream.dead()
    assert dead["id"] == "poison" and dead["why"]["kind"] == "permanent_exit_code", dead
    assert stream.depth() == {"stream": 0, "pending": 0, "delayed": 0}
    assert pandastack.engine_sandboxes("queue") == []


def test_no_prefect_sandbox_left(prefect: PrefectStack, pandastack: PandaStack) -> None:
    assert prefect_sandboxes(pandastack) == []
