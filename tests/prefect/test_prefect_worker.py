"""The ``pandastack`` work pool: real workers run real deployments' flow runs in sandboxes.

The Prefect API is the session's test harness (a real server subprocess on loopback);
the sandboxes come from a private pandastack-local with a ``prefect`` template that
carries this venv (``python_env``) and the flow code (``code_dirs``), and egress to the
harness's API port only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from uuid import UUID

import anyio
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
from prefect.client.schemas.objects import StateType
from prefect.deployments import run_deployment
from prefect.settings import PREFECT_API_URL, get_current_settings
from prefect.states import Cancelling

from pandastack_local import LocalServer
from pandastack_local.testing.waiting import wait_for
from prefect_blocks import PandaStackCredentials
from prefect_blocks.worker import (
    ENV_FILE,
    FORWARDED_SETTINGS,
    META_FLOW_RUN,
    META_POOL,
    META_WORKER,
    PandaStackWorker,
)

pytestmark = pytest.mark.timeout(300)

FLOW_CODE = """
import json, os, socket, time
from prefect import flow, get_run_logger
from prefect.settings import get_current_settings
from prefect.artifacts import create_markdown_artifact


@flow
def inside(seconds: float = 0.0, fail: bool = False) -> int:
    facts = {
        "hostname": socket.gethostname(),
        "agent": os.path.exists("/.pandastack/agent.py"),
        "env": sorted(os.environ),
        "cwd": os.getcwd(),
        "settings_api_key": get_current_settings().api.key is not None,
    }
    create_markdown_artifact(markdown=json.dumps(facts), key="inside-facts")
    get_run_logger().info("inside the sandbox on %s", facts["hostname"])
    print("printed from the flow", flush=True)
    deadline = time.time() + seconds
    while time.time() < deadline:
        time.sleep(0.2)
    if fail:
        raise RuntimeError("the flow failed on purpose")
    return 42
"""


@pytest.fixture(scope="module")
def code_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    code = tmp_path_factory.mktemp("worker-flows")
    code.chmod(0o755)  # the sandbox's root is an unprivileged host uid: code must be world-readable
    (code / "worker_flows.py").write_text(FLOW_CODE)
    return code


@pytest.fixture(scope="module")
def sandbox_server(tmp_path_factory: pytest.TempPathFactory, code_dir: Path) -> Iterator[LocalServer]:
    api = urlparse(PREFECT_API_URL.value())
    template = tmp_path_factory.mktemp("worker-template") / "prefect"
    template.mkdir()
    (template / "template.json").write_text(
        json.dumps({"name": "prefect", "python_env": sys.prefix, "code_dirs": [str(code_dir)]})
    )
    with LocalServer(
        template_dirs=[str(template)], allow_egress=[f"{api.hostname}:{api.port}"], pool_size=1
    ) as server:
        yield server


@pytest.fixture(scope="module")
def pool(sandbox_server: LocalServer, code_dir: Path) -> str:
    """A ``pandastack`` pool whose default credentials are a saved block (the key stays server-side)."""
    name = f"ps-pool-{os.getpid()}"
    block_id = PandaStackCredentials(api_url=sandbox_server.url, api_key=sandbox_server.api_key).save(
        f"worker-test-{os.getpid()}", overwrite=True
    )
    template = PandaStackWorker.get_default_base_job_template()
    template["variables"]["properties"]["credentials"]["default"] = {
        "$ref": {"block_document_id": str(block_id)}
    }
    template["variables"]["properties"]["timeout"]["default"] = 120
    return create_pool_and_deploy(name, template, code_dir, "inside")


def create_pool_and_deploy(name: str, template: dict[str, Any], code_dir: Path, deployment: str) -> str:
    """Work pool ``name`` of the ``pandastack`` type with ``template``, and worker_flows.py's
    ``inside`` flow deployed to it as ``deployment``."""

    async def create() -> None:
        async with get_client() as client:
            await client.create_work_pool(
                WorkPoolCreate(name=name, type="pandastack", base_job_template=template)
            )

    anyio.run(create)
    f = flow.from_source(source=str(code_dir), entrypoint="worker_flows.py:inside")
    f.deploy(name=deployment, work_pool_name=name, build=False, push=False, print_next_steps=False)
    return name


def start_run(parameters: dict[str, Any] | None = None) -> UUID:
    fr = run_deployment("inside/inside", parameters=parameters or {}, timeout=0)
    return fr.id


async def _read(fr_id: UUID) -> Any:
    async with get_client() as client:
        return await client.read_flow_run(fr_id)


def read_run(fr_id: UUID) -> Any:
    return anyio.run(_read, fr_id)


def inside_facts(fr_id: UUID) -> dict[str, Any]:
    async def read() -> Any:
        async with get_client() as client:
            arts = await client.read_artifacts(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr_id]))
            )
            return [a for a in arts if a.key == "inside-facts"]

    arts = anyio.run(read)
    assert arts, "the flow recorded nothing from inside"
    return dict(json.loads(arts[0].data))


def run_logs(fr_id: UUID) -> str:
    async def read() -> Any:
        async with get_client() as client:
            return await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[fr_id])))

    return "\n".join(log.message for log in anyio.run(read))


def pool_sandboxes(server: LocalServer, pool: str) -> list[Any]:
    return [sb for sb in server.client().sandboxes.list() if (sb.metadata or {}).get(META_POOL) == pool]


async def run_worker_until(
    pool: str, done: Callable[[], bool], during: Callable[[], Any] | None = None
) -> None:
    """An in-process worker: one poll, then wait (doing ``during`` once) until ``done()``."""
    async with PandaStackWorker(work_pool_name=pool, prefetch_seconds=5) as worker:
        await worker.get_and_submit_flow_runs()
        if during is not None:
            await anyio.to_thread.run_sync(during)
        with anyio.fail_after(240):
            while not await anyio.to_thread.run_sync(done):
                await anyio.sleep(0.3)


def final(fr_id: UUID) -> Callable[[], bool]:
    def check() -> bool:
        state = read_run(fr_id).state
        return state is not None and state.is_final()

    return check


def test_base_job_template_has_the_expected_fields_with_descriptions() -> None:
    template = PandaStackWorker.get_default_base_job_template()
    props = template["variables"]["properties"]
    for field in ("credentials", "template", "timeout", "ttl", "env", "command", "max_concurrent_sandboxes"):
        assert field in props, field
        assert props[field].get("description"), field
        assert field in template["job_configuration"], field
    assert props["template"]["default"] == "prefect"


def test_worker_type_is_found_through_the_collections_entry_point() -> None:
    from prefect.plugins import load_prefect_collections
    from prefect.utilities.dispatch import lookup_type
    from prefect.workers.base import BaseWorker

    load_prefect_collections()
    assert lookup_type(BaseWorker, "pandastack") is PandaStackWorker


def test_flow_run_runs_in_its_own_sandbox_and_completes(sandbox_server: LocalServer, pool: str) -> None:
    fr_id = start_run()
    anyio.run(run_worker_until, pool, final(fr_id))
    fr = read_run(fr_id)
    assert fr.state.type == StateType.COMPLETED, fr.state
    facts = inside_facts(fr_id)
    assert facts["hostname"] == "sandbox" and facts["agent"] is True
    assert "PANDASTACK_WARM" not in facts["env"], "warm_pool_size 0 (the default) runs cold"
    # infrastructure_pid is the sandbox, which is gone now.
    assert fr.infrastructure_pid and len(fr.infrastructure_pid) == 36
    assert fr.infrastructure_pid not in {sb.id for sb in sandbox_server.client().sandboxes.list()}
    assert "inside the sandbox on sandbox" in run_logs(fr_id)
    assert pool_sandboxes(sandbox_server, pool) == []


def test_failing_flow_ends_failed_and_its_sandbox_is_deleted(sandbox_server: LocalServer, pool: str) -> None:
    fr_id = start_run({"fail": True})
    anyio.run(run_worker_until, pool, final(fr_id))
    fr = read_run(fr_id)
    assert fr.state.type == StateType.FAILED, fr.state
    assert "failed on purpose" in run_logs(fr_id)
    assert pool_sandboxes(sandbox_server, pool) == []


def test_only_what_the_flow_run_needs_enters_the_sandbox(sandbox_server: LocalServer, pool: str) -> None:
    fr_id = start_run({"seconds": 150})
    seen: dict[str, str] = {}

    def search() -> None:
        sb = wait_for(
            "the flow run's sandbox", lambda: pool_sandboxes(sandbox_server, pool), timeout=120, interval=0.3
        )[0]
        wait_for(
            "the flow to start",
            lambda: read_run(fr_id).state.type == StateType.RUNNING,
            timeout=90,
            interval=0.3,
        )
        sandbox = sandbox_server.client(timeout=180).sandboxes.get(sb.id)
        # Everything a job could read: every process's environment and command line, every file
        # under the writable and bound directories (the venv is read-only and came from the host).
        out = sandbox.exec(
            "for p in /proc/[0-9]*; do cat $p/environ $p/cmdline 2>/dev/null; echo; done; "
            "find /work /root /tmp /var/tmp /etc /.pandastack -type f -size -2M "
            "-exec cat {} + 2>/dev/null",
            timeout_seconds=150,
        )
        seen["dump"] = out.stdout
        seen["env"] = sandbox.exec("cat /proc/[0-9]*/environ | tr '\\0' '\\n'", timeout_seconds=60).stdout
        seen["sent"] = sandbox.exec(f"cat {ENV_FILE}", timeout_seconds=60).stdout
        anyio.from_thread.run(_cancel, fr_id)

    anyio.run(run_worker_until, pool, final(fr_id), search)
    assert sandbox_server.api_key not in seen["dump"]
    assert sandbox_server.api_key[4:] not in seen["dump"]
    names = {line.split("=", 1)[0] for line in seen["env"].splitlines() if "=" in line}
    assert {"PREFECT_API_URL", "PREFECT__FLOW_RUN_ID"} <= names
    assert not {n for n in names if n.startswith("PANDASTACK")}
    # What the worker sent is the API URL, the run's ids and attribution; none of its other settings.
    sent = {line.split("=", 1)[0].removeprefix("export ") for line in seen["sent"].splitlines()}
    assert "PREFECT_API_URL" in sent
    assert all(n.startswith("PREFECT__") or n in FORWARDED_SETTINGS for n in sent), sent
    worker_settings = get_current_settings().to_environment_variables(exclude_unset=True)
    # Distinctive values only: a flag like "true" may be set inside by Prefect itself.
    withheld = {k: v for k, v in worker_settings.items() if k not in FORWARDED_SETTINGS and len(v) > 8}
    assert withheld, "the worker has settings of its own (the harness's database at least)"
    for name, value in withheld.items():
        assert f"{name}={value}" not in seen["dump"], name
    assert f"PREFECT__FLOW_RUN_ID={fr_id}" in seen["env"]


async def _cancel(fr_id: UUID) -> None:
    async with get_client() as client:
        await client.set_flow_run_state(fr_id, Cancelling(), force=True)


def test_cancelling_deletes_the_sandbox_and_the_run_ends_cancelled(
    sandbox_server: LocalServer, pool: str
) -> None:
    fr_id = start_run({"seconds": 120})
    timing: dict[str, float] = {}

    def cancel_when_running() -> None:
        wait_for(
            "the flow run's sandbox", lambda: pool_sandboxes(sandbox_server, pool), timeout=120, interval=0.3
        )
        wait_for(
            "the flow to start",
            lambda: read_run(fr_id).state.type == StateType.RUNNING,
            timeout=90,
            interval=0.3,
        )
        timing["cancelled"] = time.monotonic()
        anyio.from_thread.run(_cancel, fr_id)

    anyio.run(run_worker_until, pool, final(fr_id), cancel_when_running)
    fr = read_run(fr_id)
    assert fr.state.type == StateType.CANCELLED, fr.state
    assert pool_sandboxes(sandbox_server, pool) == []
    assert time.monotonic() - timing["cancelled"] < 60


def test_cli_worker_runs_a_flow_run_and_a_killed_workers_sandbox_is_swept(
    sandbox_server: LocalServer, pool: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``prefect worker start --type pandastack``, SIGKILLed mid-run: the next worker's sweep deletes
    the orphaned sandbox and marks the run Crashed."""
    fr_id = start_run({"seconds": 120})
    env = {k: v for k, v in os.environ.items() if not k.startswith("PANDASTACK")}
    env.update(PREFECT_API_URL=PREFECT_API_URL.value(), PREFECT_WORKER_HEARTBEAT_SECONDS="1")
    prefect_cli = str(Path(sys.executable).with_name("prefect"))
    worker = subprocess.Popen(
        [prefect_cli, "worker", "start", "--pool", pool, "--type", "pandastack", "--name", "doomed"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        orphan = wait_for(
            "the CLI worker's sandbox",
            lambda: pool_sandboxes(sandbox_server, pool),
            timeout=180,
            interval=0.3,
        )[0]
        assert orphan.metadata[META_WORKER] == "doomed"
        assert orphan.metadata[META_FLOW_RUN] == str(fr_id)
        wait_for(
            "the flow to start",
            lambda: read_run(fr_id).state.type == StateType.RUNNING,
            timeout=90,
            interval=0.3,
        )
        assert read_run(fr_id).infrastructure_pid == orphan.id
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=30)
    assert [sb.id for sb in pool_sandboxes(sandbox_server, pool)] == [orphan.id], "the kill removed it"
    monkeypatch.setattr("prefect_blocks.worker.MIN_OFFLINE_SECONDS", 3.0)
    time.sleep(4)  # three missed 1 s heartbeats (and the lowered floor): the dead worker is offline

    async def sweep() -> list[str]:
        async with PandaStackWorker(work_pool_name=pool, name="survivor") as survivor:
            creds = PandaStackCredentials(api_url=sandbox_server.url, api_key=sandbox_server.api_key)
            return await survivor.sweep_orphans(creds)

    assert anyio.run(sweep) == [orphan.id]
    assert pool_sandboxes(sandbox_server, pool) == []
    assert read_run(fr_id).state.type == StateType.CRASHED
