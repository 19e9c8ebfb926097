"""Warm starts of ``PandaStackDriver`` against a real pandastack-local server: the core's real
``StandbyPool`` makes standbys (a runner with the module imported, waiting on its socket) and the
driver launches tries into them.

The try is a small module (``warmprobe``, shipped with the standbys) that prints its parent's
command line: under the runner the parent is ``warm_runner.py``; cold it is the job's shell. A
killed runner and a deleted standby must each still give a successful try, cold.

The sweep of another scheduler reads (an exec: activity, which resets the idle TTL) and deletes
only a gone owner's standbys; a live owner's idle standby's TTL runs on untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pandastack
import pytest

from airflow_provider.executors.driver import ENGINE, REQUEST_LABEL, REQUEST_PATH, PandaStackDriver
from airflow_provider.executors.models import SandboxHandle, SandboxLaunchRequest, SandboxState
from pandastack_jobs import ConnectionConfig, WarmStart, guest
from pandastack_jobs.warm_start import PID_PATH, STANDBY_LABEL, WARM_DIR

PROBE = """
import os, sys
parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
print("PARENT=" + parent)
print("TENANT=" + os.environ.get("TENANT", ""))
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
"""
ENV = {"PYTHONPATH": WARM_DIR}  # a cold run finds the probe too
LABELS = {"dag_id": "d", "task_id": "t", "run_id": "r", "map_index": "-1", "try_number": "1"}


def warm_start() -> WarmStart:
    """The probe as the module the standby's runner imports (its top level must not run twice:
    it is imported by name here, and ``runpy`` runs it as ``__main__`` in the try)."""
    return WarmStart(
        template="code-interpreter",
        python="python3",
        modules=("warmprobe",),
        env=ENV,
        files={f"{WARM_DIR}/warmprobe.py": "if __name__ == '__main__':\n" + _indent(PROBE)},
    )


def _indent(text: str) -> str:
    return "".join(f"    {line}\n" for line in text.strip().splitlines())


@pytest.fixture
def driver(local_server: Any) -> Iterator[PandaStackDriver]:
    driver = PandaStackDriver(ConnectionConfig(api_url=local_server.url, api_key=local_server.api_key))
    driver.open_standbys([warm_start()], 1)
    try:
        yield driver
    finally:
        asyncio.run(driver.close())
        for sb in local_server.client().sandboxes.list():
            sb.kill()


def ready_standby(local_server: Any, limit: float = 180) -> Any:
    client = local_server.client()
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        for sb in client.sandboxes.list():
            if STANDBY_LABEL in (sb.metadata or {}):
                if sb.exec(f"test -S {WARM_DIR}/runner.sock", timeout_seconds=30).exit_code == 0:
                    time.sleep(0.5)  # the pool marks it ready right after the socket
                    return sb
        time.sleep(0.3)
    raise AssertionError("no standby became ready")


def request(env: dict[str, str] | None = None) -> SandboxLaunchRequest:
    return SandboxLaunchRequest(
        str(uuid.uuid4()),
        ("python3", "-m", "warmprobe"),
        {**ENV, "TENANT": "acme", **(env or {})},
        provider_config={
            "template": "code-interpreter",
            "labels": {"dag_id": "d", "task_id": "t", "run_id": "r", "map_index": "-1", "try_number": "1"},
        },
        workdir=None,
        timeout_seconds=60,
        ttl_seconds=120,
    )


def run(driver: PandaStackDriver, req: SandboxLaunchRequest) -> tuple[SandboxHandle, str]:
    handle = asyncio.run(driver.launch(req))
    deadline = time.monotonic() + 120
    while (result := asyncio.run(driver.get_status(handle))).state is SandboxState.RUNNING:
        assert time.monotonic() < deadline, "the try did not end"
        time.sleep(0.2)
    output = asyncio.run(driver.get_output(handle))
    assert result.state is SandboxState.SUCCEEDED, (result, output)
    assert output is not None and "TENANT=acme" in output.stdout  # the try's own env, at run time
    asyncio.run(driver.terminate(handle))
    return handle, output.stdout


@pytest.mark.timeout(600)
def test_a_try_runs_under_the_standbys_runner(driver: PandaStackDriver, local_server: Any) -> None:
    standby = ready_standby(local_server)
    handle, out = run(driver, request())
    assert handle.display_name == standby.id and handle.data["standby"] == warm_start().key()
    assert "warm_runner.py" in out, out
    assert standby.id not in {sb.id for sb in local_server.client().sandboxes.list()}  # gone with its try


@pytest.mark.timeout(600)
def test_a_killed_runner_still_runs_the_try_cold_in_the_standby(
    driver: PandaStackDriver, local_server: Any
) -> None:
    standby = ready_standby(local_server)
    assert standby.exec(f'kill -9 "$(cat {PID_PATH})"', timeout_seconds=30).exit_code == 0
    handle, out = run(driver, request())
    assert handle.display_name == standby.id and "warm_runner.py" not in out, out


@pytest.mark.timeout(600)
def test_a_standby_deleted_before_launch_gives_a_cold_sandbox(
    driver: PandaStackDriver, local_server: Any
) -> None:
    standby = ready_standby(local_server)
    local_server.client().sandboxes.delete(standby.id)
    req = request()
    handle = asyncio.run(driver.launch(req))
    sb = local_server.client().sandboxes.get(handle.display_name)
    assert handle.display_name != standby.id and "standby" not in handle.data
    assert sb.metadata[REQUEST_LABEL] == req.request_id
    asyncio.run(driver.terminate(handle))


@pytest.mark.timeout(600)
def test_close_deletes_the_untaken_standbys(driver: PandaStackDriver, local_server: Any) -> None:
    ready_standby(local_server)
    asyncio.run(driver.close())
    left = [sb.id for sb in local_server.client().sandboxes.list() if STANDBY_LABEL in (sb.metadata or {})]
    assert left == []


def owned_standby(client: Any, owner: str) -> Any:
    """A standby as another scheduler's pool made it (no runner: the sweep reads only its file)."""
    meta = {STANDBY_LABEL: "k", "job_engine": str(ENGINE), "owner": owner}
    return client.sandboxes.create(template="base", ttl_seconds=120, metadata=meta)


def sweeper(local_server: Any) -> PandaStackDriver:
    """Another scheduler's driver whose owner check calls owner "gone" gone and "live" alive."""

    def owners_alive(metadata: Any) -> list[bool | None]:
        return [{"gone": False, "live": True}.get(meta.get("owner")) for meta in metadata]

    config = ConnectionConfig(api_url=local_server.url, api_key=local_server.api_key)
    return PandaStackDriver(config, owners_alive=owners_alive)


@pytest.mark.timeout(300)
def test_a_fifo_in_place_of_a_request_file_does_not_stall_the_sweep(local_server: Any) -> None:
    """A try owns its standby and may put a FIFO where its request file was: the host's bounded
    read must not block on it (``head`` did, until the 30 s client timeout, per such standby)."""
    client = local_server.client()
    hostile = owned_standby(client, "gone")  # the sweep reads only a gone owner's standbys
    try:
        made = hostile.exec(f"mkdir -p {guest.DETACHED_DIR} && mkfifo {REQUEST_PATH}", timeout_seconds=30)
        assert made.exit_code == 0, made.stderr
        started = time.monotonic()
        assert asyncio.run(sweeper(local_server).list_requests()) == {}
        assert time.monotonic() - started < 10
    finally:
        with contextlib.suppress(pandastack.NotFoundError):
            hostile.kill()


@pytest.mark.timeout(300)
def test_the_sweep_deletes_a_gone_schedulers_idle_standby_and_never_touches_a_live_ones(
    local_server: Any,
) -> None:
    """A killed scheduler's idle standby goes (it never reaches its idle TTL while a sweep reads
    it), its taken one is still found as a try, and a live scheduler's idle standby is not even
    read: its idle time runs on."""
    client = local_server.client()
    gone_idle, gone_taken, live_idle = (owned_standby(client, o) for o in ("gone", "gone", "live"))
    try:
        body = shlex.quote(json.dumps({"request_id": "r-1", "labels": LABELS}))
        wrote = gone_taken.exec(
            f"mkdir -p {guest.DETACHED_DIR} && printf %s {body} > {REQUEST_PATH}", timeout_seconds=30
        )
        assert wrote.exit_code == 0, wrote.stderr
        time.sleep(2.5)
        assert asyncio.run(sweeper(local_server).list_requests()) == {"r-1": LABELS}
        left = {sb.id for sb in client.sandboxes.list()}
        assert gone_idle.id not in left and {gone_taken.id, live_idle.id} <= left
        assert live_idle.lifecycle()["idle_seconds"] >= 2  # no request reached it
    finally:
        for sb in (gone_idle, gone_taken, live_idle):
            with contextlib.suppress(pandastack.NotFoundError):
                sb.kill()
