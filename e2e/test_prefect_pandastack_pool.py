"""Prefect 3.9 ``pandastack`` work pool in the production shape: a Prefect server on PostgreSQL,
two ``prefect worker start --type pandastack`` workers, and a pandastack-local whose ``prefect``
template carries the Prefect venv and the flow code, with egress to the Prefect API only."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from pandastack_local.testing.waiting import wait_for

from .prefect_stack import PrefectStack, prefect_env, start_server
from .procs import Proc, ProcessGroup, free_port
from .services import REPO, PandaStack, Postgres, start_pandastack

pytestmark = pytest.mark.timeout(900)

POOL = "e2e-pandastack-pool"
BLOCK = "e2e-pool-credentials"
WORKERS = ("sandbox-worker-a", "sandbox-worker-b")


class PoolStack(PrefectStack):
    sandboxes_server: PandaStack

    def start_sandbox_worker(self, name: str) -> Proc:
        return self.start_worker(name, pool=POOL, worker_type="pandastack")

    def online(self) -> list[str]:
        return self.online_workers(POOL)

    def pool_sandboxes(self) -> list[dict[str, Any]]:
        return [
            sb
            for sb in self.sandboxes_server.sandboxes()
            if (sb.get("metadata") or {}).get("prefect_work_pool") == POOL
        ]

    def facts(self, flow_run_id: str) -> list[dict[str, Any]]:
        return [
            json.loads(a["data"]) for a in self.artifacts(flow_run_id) if a.get("key") == "pool-inside-facts"
        ]


def start_sandbox_server(group: ProcessGroup, prefect_port: int) -> PandaStack:
    """pandastack-local with the ``prefect`` template and egress to the Prefect API only."""
    template = group.run_dir / "pool-templates" / "prefect"
    template.mkdir(parents=True)
    (template / "template.json").write_text(
        json.dumps(
            {
                "name": "prefect",
                "python_env": str(REPO / ".venv-prefect"),
                "code_dirs": [str(REPO / "e2e" / "pool_flows")],
            }
        )
    )
    return start_pandastack(
        group,
        sys.executable,
        "pandastack-local-pool",
        ["--template-dir", str(template), "--allow-egress", f"127.0.0.1:{prefect_port}"],
    )


@pytest.fixture(scope="module")
def pool(group: ProcessGroup, postgres: Postgres) -> Iterator[PoolStack]:
    postgres.create_db("prefect_pool")
    port = free_port()
    ps = start_sandbox_server(group, port)
    env = prefect_env(group.run_dir, postgres, ps, port)
    env = {k: v for k, v in env.items() if "PANDASTACK_API" not in k}  # the block has the key
    home = group.run_dir / "prefect-pool"
    home.mkdir()
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_PROFILES_PATH=str(home / "profiles.toml"),
        PREFECT_API_DATABASE_CONNECTION_URL=postgres.url("prefect_pool", driver="asyncpg"),
        PREFECT_WORKER_HEARTBEAT_SECONDS="2",
    )
    stack = start_server(PoolStack(group, env, port), "prefect-server-pool", "--no-ui")
    stack.sandboxes_server = ps
    stack.python(
        "-m", "e2e.prefect_pool_setup", "--pool", POOL, "--block", BLOCK,
        "--api-url", ps.url, "--api-key", ps.api_key, timeout=300,
    )  # fmt: skip
    for name in WORKERS:
        stack.start_sandbox_worker(name)
    wait_for("two pandastack workers online", stack.online, timeout=180, interval=0.5,
             check=lambda names: set(WORKERS) <= set(names))  # fmt: skip
    try:
        yield stack
    finally:
        for proc in [p for p in group.procs if p.name.startswith("prefect-sandbox-worker")]:
            proc.stop()
        group.get("prefect-server-pool").stop()
        group.get("pandastack-local-pool").stop()


def test_deployment_runs_in_a_sandbox_asserted_from_inside(pool: PoolStack) -> None:
    fr_id = pool.run_deployment("pool-inside", "pool", {"pandastack_port": pool.sandboxes_server.port})
    fr = pool.wait_flow_run(fr_id, timeout=300)
    assert fr["state_type"] == "COMPLETED", fr["state"]
    (facts,) = pool.facts(fr_id)
    assert facts["hostname"] == "sandbox" and facts["agent"] is True
    assert facts["pandastack_api_reachable"] is False
    assert not [n for n in facts["env"] if n.startswith("PANDASTACK")]
    assert fr["infrastructure_pid"]
    # The flow reports Completed from inside before its process exits; the worker deletes after.
    wait_for("no sandbox left", lambda: pool.pool_sandboxes() == [], timeout=60, interval=0.5)


def test_cancelled_run_leaves_no_sandbox(pool: PoolStack) -> None:
    fr_id = pool.run_deployment("pool-inside", "pool", {"seconds": 120})
    wait_for("the flow run to be running", lambda: pool.flow_run(fr_id)["state_type"] == "RUNNING",
             timeout=240, interval=0.5)  # fmt: skip
    assert pool.pool_sandboxes()
    pool.set_state(fr_id, "CANCELLING")
    fr = pool.wait_flow_run(fr_id, timeout=120)
    assert fr["state_type"] == "CANCELLED", fr["state"]
    wait_for("no sandbox left", lambda: pool.pool_sandboxes() == [], timeout=30, interval=0.5)


def test_killed_worker_is_recovered_by_the_other_workers_sweep(pool: PoolStack) -> None:
    fr_id = pool.run_deployment("pool-inside", "pool", {"seconds": 240})
    wait_for("the flow run to be running", lambda: pool.flow_run(fr_id)["state_type"] == "RUNNING",
             timeout=240, interval=0.5)  # fmt: skip
    (sandbox,) = pool.pool_sandboxes()
    victim = sandbox["metadata"]["prefect_worker"]
    assert victim in WORKERS
    assert pool.flow_run(fr_id)["infrastructure_pid"] == sandbox["id"]
    proc = pool.workers[victim]
    proc.kill_group(signal.SIGKILL)
    proc.popen.wait(timeout=10)
    assert [sb["id"] for sb in pool.pool_sandboxes()] == [sandbox["id"]], "the kill alone removed it"
    fr = pool.wait_flow_run(fr_id, timeout=180)
    assert fr["state_type"] == "CRASHED", fr["state"]
    wait_for("the orphan to be swept", lambda: pool.pool_sandboxes() == [], timeout=60, interval=0.5)
    pool.group.procs.remove(proc)
    pool.start_sandbox_worker(victim)
    wait_for("both workers online again", pool.online, timeout=180, interval=0.5,
             check=lambda names: set(WORKERS) <= set(names))  # fmt: skip


def test_two_workers_share_the_pool_and_run_each_flow_run_once(pool: PoolStack) -> None:
    ids = [pool.run_deployment("pool-inside", "pool", {"seconds": 1}) for _ in range(6)]
    for fr_id in ids:
        fr = pool.wait_flow_run(fr_id, timeout=400)
        assert fr["state_type"] == "COMPLETED", fr["state"]
        assert fr["run_count"] == 1, fr
        assert len(pool.facts(fr_id)) == 1, "the flow run ran more than once"
    wait_for("no sandbox left", lambda: pool.pool_sandboxes() == [], timeout=60, interval=0.5)
