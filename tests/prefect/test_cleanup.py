"""Process-level failures: a worker killed mid-job, a crashed flow run and a cancelled one.

Each runs a real flow in a separate process against pandastack_local and checks
the server for sandboxes afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import pandastack
from prefect.client.orchestration import get_client
from prefect.flow_engine import run_flow
from prefect.settings import PREFECT_API_URL
from prefect.states import Crashed, Scheduled

HERE = Path(__file__).parent
RUNNER = """
import sys
from uuid import UUID
sys.path.insert(0, {here!r})
import prefect_test_flows as flows
from prefect.client.orchestration import get_client
from prefect.flow_engine import run_flow
with get_client(sync_client=True) as client:
    flow_run = client.read_flow_run(UUID({flow_run_id!r}))
run_flow(getattr(flows, {flow!r}), flow_run=flow_run, parameters={{"sleep": {sleep}}})
"""


def subprocess_env(local_server: Any) -> dict[str, str]:
    return {**os.environ, **local_server.env(), "PREFECT_API_URL": PREFECT_API_URL.value()}


def start_flow_run_process(local_server: Any, flow: Any, sleep: int) -> tuple[UUID, subprocess.Popen]:
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(flow, parameters={"sleep": sleep})
    code = RUNNER.format(here=str(HERE), flow_run_id=str(flow_run.id), flow=flow.fn.__name__, sleep=sleep)
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=subprocess_env(local_server),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return flow_run.id, proc


def wait_for_job_sandbox(client: pandastack.Client, flow_run_id: UUID, proc: subprocess.Popen) -> Any:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for sb in client.sandboxes.list():
            if sb.metadata.get("job_run") == str(flow_run_id):
                return sb
        if proc.poll() is not None:
            raise AssertionError(f"flow process exited early: {proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.1)
    raise AssertionError("the job's sandbox never appeared")


def test_killed_worker_then_retried_leaves_no_orphan(local_server, ps_client, monkeypatch) -> None:
    from tests.prefect import prefect_test_flows as flows

    flow_run_id, proc = start_flow_run_process(local_server, flows.killed_worker_flow, sleep=300)
    try:
        orphan = wait_for_job_sandbox(ps_client, flow_run_id, proc)
        time.sleep(0.5)  # the job is executing now
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    # The worker died without running any cleanup: its sandbox is an orphan.
    assert ps_client.sandboxes.get(orphan.id).id == orphan.id
    assert orphan.metadata["job_try"] == "1001"

    # What Prefect does with a run whose worker vanished: it is marked crashed, then retried.
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Crashed(message="worker killed"), force=True)
        client.set_flow_run_state(flow_run_id, Scheduled(), force=True)
        flow_run = client.read_flow_run(flow_run_id)
    for name, value in local_server.env().items():
        monkeypatch.setenv(name, value)
    state = run_flow(
        flows.killed_worker_flow, flow_run=flow_run, parameters={"sleep": 0}, return_type="state"
    )
    assert state.is_completed(), state.message
    assert state.result() == {"done": True}
    # The retry reaped the dead attempt's sandbox before creating its own, then deleted its own.
    try:
        ps_client.sandboxes.get(orphan.id)
        raise AssertionError(f"orphan {orphan.id} survived the retry")
    except pandastack.NotFoundError:
        pass
    assert ps_client.sandboxes.list() == []


def test_crashed_flow_run_leaves_no_sandbox(local_server, ps_client) -> None:
    from tests.prefect import prefect_test_flows as flows

    flow_run_id, proc = start_flow_run_process(local_server, flows.cancellable_flow, sleep=300)
    try:
        sandbox = wait_for_job_sandbox(ps_client, flow_run_id, proc)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)  # what an infrastructure shutdown sends
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(flow_run_id).state.is_crashed()
    try:
        ps_client.sandboxes.get(sandbox.id)
        raise AssertionError(f"sandbox {sandbox.id} survived the crash")
    except pandastack.NotFoundError:
        pass


SERVE = """
import sys
sys.path.insert(0, {here!r})
import prefect_test_flows as flows
flows.cancellable_flow.serve(name="cancel-test")
"""


def test_cancelled_flow_run_leaves_no_sandbox(local_server, ps_client) -> None:
    from prefect.states import Cancelling

    env = {**subprocess_env(local_server), "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    server = subprocess.Popen(
        [sys.executable, "-c", SERVE.format(here=str(HERE))],
        env=env,
        cwd=str(HERE),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with get_client(sync_client=True) as client:
            deadline = time.monotonic() + 60
            deployment = None
            while deployment is None:
                try:
                    deployment = client.read_deployment_by_name("cancellable-flow/cancel-test")
                except Exception:
                    if time.monotonic() > deadline or server.poll() is not None:
                        raise
                    time.sleep(0.5)
            flow_run = client.create_flow_run_from_deployment(deployment.id, parameters={"sleep": 300})
            sandbox = wait_for_job_sandbox(ps_client, flow_run.id, server)
            client.set_flow_run_state(flow_run.id, Cancelling(message="user cancelled"))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                state = client.read_flow_run(flow_run.id).state
                if state is not None and state.is_cancelled():
                    break
                time.sleep(0.5)
            assert state is not None and state.is_cancelled(), state
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all(sb.id != sandbox.id for sb in ps_client.sandboxes.list()):
                break
            time.sleep(0.2)
        assert all(sb.id != sandbox.id for sb in ps_client.sandboxes.list()), "sandbox survived cancellation"
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        print("runner stderr:", server.stderr.read()[-6000:] if server.stderr else "")
