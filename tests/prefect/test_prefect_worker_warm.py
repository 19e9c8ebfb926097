"""Warm starts of the ``pandastack`` worker: real workers, a real Prefect API, real standbys.

A work pool with ``warm_pool_size=1`` on the same private pandastack-local as the cold worker
tests. Each test starts a worker, lets its standby pool fill, then runs one flow run; the flow
records its environment, so ``PANDASTACK_WARM`` (set by the warm runner's fork) shows where it ran.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any
from uuid import UUID

import anyio
import pytest
from prefect.client.schemas.objects import StateType
from prefect.deployments import run_deployment

from pandastack_jobs.reaper import delete_sandbox
from pandastack_jobs.warm_start import PID_PATH, STANDBY_LABEL
from pandastack_local import LocalServer
from pandastack_local.testing.waiting import wait_for
from prefect_blocks import PandaStackCredentials
from prefect_blocks.warm import META_INSTANCE, SETTINGS_FILE
from prefect_blocks.worker import META_POOL, PandaStackWorker
from tests.prefect import test_prefect_worker as cold
from tests.prefect.test_prefect_worker import create_pool_and_deploy, final, inside_facts, read_run, run_logs

pytestmark = pytest.mark.timeout(300)
# The cold tests' module fixtures: the same Prefect flows and private pandastack-local.
code_dir = cold.code_dir
sandbox_server = cold.sandbox_server


SECRET = "pnu_warmtestsecret0123456789abcdefghij"


def make_warm_pool(server: LocalServer, code_dir: Any, name: str, env: dict[str, str]) -> str:
    block_id = PandaStackCredentials(api_url=server.url, api_key=server.api_key).save(
        f"warm-test-{os.getpid()}", overwrite=True
    )
    template = PandaStackWorker.get_default_base_job_template()
    props = template["variables"]["properties"]
    props["credentials"]["default"] = {"$ref": {"block_document_id": str(block_id)}}
    props["timeout"]["default"] = 120
    props["warm_pool_size"]["default"] = 1
    props["env"]["default"] = env
    return create_pool_and_deploy(name, template, code_dir, name)


@pytest.fixture(scope="module")
def warm_pool(sandbox_server: LocalServer, code_dir: Any) -> str:
    return make_warm_pool(sandbox_server, code_dir, f"ps-warm-{os.getpid()}", {})


def standbys(server: LocalServer, pool: str) -> list[Any]:
    return [
        sb
        for sb in server.client().sandboxes.list()
        if (sb.metadata or {}).get(META_POOL) == pool and STANDBY_LABEL in (sb.metadata or {})
    ]


async def warm_run(
    pool: str, before: Callable[[list[Any]], Any] | None, server: LocalServer
) -> tuple[UUID, list[Any], PandaStackWorker]:
    """A worker whose pool is filled; ``before(ready standbys)``, then one flow run to its end."""
    async with PandaStackWorker(work_pool_name=pool, prefetch_seconds=5) as worker:
        standby_pool = await worker.prewarm()
        assert standby_pool is not None
        with anyio.fail_after(180):
            while standby_pool.ready < 1:
                await anyio.sleep(0.2)
        ready = await anyio.to_thread.run_sync(standbys, server, pool)
        assert len(ready) == 1, ready
        assert ready[0].metadata[META_INSTANCE] == worker._instance
        # The orphan sweep leaves a live worker's own standby to its pool.
        creds = PandaStackCredentials(api_url=server.url, api_key=server.api_key)
        assert await worker.sweep_orphans(creds) == []
        assert standby_pool.ready == 1
        if before is not None:
            await anyio.to_thread.run_sync(before, ready)
        fr = await run_deployment(f"inside/{pool}", timeout=0)
        await worker.get_and_submit_flow_runs()
        check = final(fr.id)
        with anyio.fail_after(240):
            while not await anyio.to_thread.run_sync(check):
                await anyio.sleep(0.3)
    return fr.id, ready, worker


def test_a_flow_run_runs_warm_on_a_standby_and_the_pool_closes_with_the_worker(
    sandbox_server: LocalServer, warm_pool: str
) -> None:
    seen: dict[str, str] = {}

    def dump(ready: list[Any]) -> None:
        """Everything a waiting standby holds: its processes' env and argv, its files."""
        sb = sandbox_server.client(timeout=120).sandboxes.get(ready[0].id)
        seen["dump"] = sb.exec(
            "for p in /proc/[0-9]*; do cat $p/environ $p/cmdline 2>/dev/null; echo; done; "
            "find /work /root /tmp /etc /.pandastack -type f -size -2M -exec cat {} + 2>/dev/null",
            timeout_seconds=100,
        ).stdout

    fr_id, ready, _ = anyio.run(warm_run, warm_pool, dump, sandbox_server)
    assert "PREFECT_API_URL" in seen["dump"], "the dump saw the runner's environment"
    assert sandbox_server.api_key not in seen["dump"] and sandbox_server.api_key[4:] not in seen["dump"]
    fr = read_run(fr_id)
    assert fr.state.type == StateType.COMPLETED, fr.state
    assert fr.infrastructure_pid == ready[0].id, "the flow run ran in the standby's sandbox"
    facts = inside_facts(fr_id)
    assert "PANDASTACK_WARM" in facts["env"], "the flow ran in the warm runner's fork"
    assert "PREFECT__FLOW_RUN_ID" in facts["env"]
    # The worker stopped: its refilled standby is deleted, nothing of the pool is left.
    assert standbys(sandbox_server, warm_pool) == []
    assert [
        sb for sb in sandbox_server.client().sandboxes.list() if sb.metadata.get(META_POOL) == warm_pool
    ] == []


def test_a_killed_runner_still_completes_the_flow_run_cold_in_the_standby(
    sandbox_server: LocalServer, warm_pool: str
) -> None:
    def kill_runner(ready: list[Any]) -> None:
        sb = sandbox_server.client().sandboxes.get(ready[0].id)
        out = sb.exec(f'kill -9 "$(cat {PID_PATH})"', timeout_seconds=30)
        assert out.exit_code == 0, out.stderr

    fr_id, ready, _ = anyio.run(warm_run, warm_pool, kill_runner, sandbox_server)
    fr = read_run(fr_id)
    assert fr.state.type == StateType.COMPLETED, fr.state
    assert fr.infrastructure_pid == ready[0].id, "it ran in the same sandbox"
    assert "PANDASTACK_WARM" not in inside_facts(fr_id)["env"], "cold: no runner to fork it"
    assert standbys(sandbox_server, warm_pool) == []


def test_a_standby_deleted_before_use_means_a_cold_fresh_sandbox(
    sandbox_server: LocalServer, warm_pool: str
) -> None:
    def delete(ready: list[Any]) -> None:
        assert delete_sandbox(sandbox_server.client(), ready[0].id)
        wait_for("the standby to go", lambda: not standbys(sandbox_server, warm_pool), timeout=30)

    fr_id, ready, _ = anyio.run(warm_run, warm_pool, delete, sandbox_server)
    fr = read_run(fr_id)
    assert fr.state.type == StateType.COMPLETED, fr.state
    assert fr.infrastructure_pid and fr.infrastructure_pid != ready[0].id
    wait_for(
        "the worker's log line on the flow run",
        lambda: "it was gone, so it ran cold in a fresh sandbox" in run_logs(fr_id),
        timeout=30,
        interval=0.5,
    )
    assert "PANDASTACK_WARM" not in inside_facts(fr_id)["env"]
    assert standbys(sandbox_server, warm_pool) == []


def test_warm_pool_size_zero_makes_no_standby(sandbox_server: LocalServer, warm_pool: str) -> None:
    """The cold pool (``warm_pool_size`` 0, the default): no standby, the flow not under a runner."""
    fr = run_deployment(f"inside/{warm_pool}", job_variables={"warm_pool_size": 0}, timeout=0)

    async def go() -> None:
        async with PandaStackWorker(work_pool_name=warm_pool, prefetch_seconds=5) as worker:
            await worker.get_and_submit_flow_runs()
            check = final(fr.id)
            with anyio.fail_after(240):
                while not await anyio.to_thread.run_sync(check):
                    # The work pool's default (1) is prewarmed on the first poll; this run's is 0.
                    await anyio.sleep(0.3)
            assert worker.warm_pools().pools and all(p.size == 1 for p in worker.warm_pools().pools)

    anyio.run(go)
    assert read_run(fr.id).state.type == StateType.COMPLETED
    assert "PANDASTACK_WARM" not in inside_facts(fr.id)["env"]
    assert standbys(sandbox_server, warm_pool) == []


def test_the_prefect_api_key_reaches_the_runner_by_file_and_no_command_line(
    sandbox_server: LocalServer, code_dir: Any
) -> None:
    """A pool whose flow runs get ``PREFECT_API_KEY``: the runner imports Prefect under it (read
    from a file), the sandbox's log of commands never shows it, the flow run still runs warm."""
    pool = make_warm_pool(sandbox_server, code_dir, f"ps-warm-key-{os.getpid()}", {"PREFECT_API_KEY": SECRET})
    seen: dict[str, str] = {}

    def look(ready: list[Any]) -> None:
        sb = sandbox_server.client().sandboxes.get(ready[0].id)
        seen["log"] = "\n".join(sb.logs())  # first: the log keeps the output of these execs too
        seen["runner_env"] = sb.exec(f'cat /proc/"$(cat {PID_PATH})"/environ', timeout_seconds=30).stdout
        seen["file"] = sb.exec(f"cat {SETTINGS_FILE}", timeout_seconds=30).stdout

    fr_id, _, _ = anyio.run(warm_run, pool, look, sandbox_server)
    assert SECRET in seen["file"]
    assert "PREFECT_API_URL" in seen["runner_env"] and SECRET not in seen["runner_env"], "not exec'd with it"
    assert "warm_runner.py" in seen["log"], "the log records the runner's launch command"
    assert SECRET not in seen["log"]
    # Prefect's settings in the flow are the runner's, from import time: the key was there.
    assert inside_facts(fr_id)["settings_api_key"] is True
    assert read_run(fr_id).state.type == StateType.COMPLETED
    assert "PANDASTACK_WARM" in inside_facts(fr_id)["env"]
    assert standbys(sandbox_server, pool) == []
