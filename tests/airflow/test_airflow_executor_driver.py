"""The executor's driver contract against a real pandastack-local server, and its value objects.

Every call goes over HTTP through the real ``pandastack`` SDK into real sandboxes:
launch / get_status / terminate / fence / recover, idempotence, the try's UUID on
the sandbox metadata, capacity refusals with ``Retry-After``, and no PandaStack key
anywhere in the sandbox.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

from airflow_provider.executors.driver import REQUEST_LABEL, PandaStackDriver, SandboxLaunchError
from airflow_provider.executors.models import (
    SandboxCapacityError,
    SandboxConfigurationError,
    SandboxExecutionRef,
    SandboxHandle,
    SandboxInvalidHandleError,
    SandboxLaunchRequest,
    SandboxState,
)
from pandastack_jobs import ConnectionConfig


def _driver(server: Any, budget: float = 0) -> PandaStackDriver:
    return PandaStackDriver(
        ConnectionConfig(api_url=server.url, api_key=server.api_key, max_create_retry_seconds=budget)
    )


def _request(argv: list[str], *, timeout: int = 60, env: dict[str, str] | None = None, rid: str = "") -> Any:
    return SandboxLaunchRequest(
        request_id=rid or str(uuid.uuid4()),
        command=tuple(argv),
        env=env or {},
        provider_config={
            "template": "code-interpreter",
            "labels": {"dag_id": "d", "task_id": "t", "run_id": "r", "map_index": "-1", "try_number": "1"},
        },
        workdir=None,
        timeout_seconds=timeout,
        ttl_seconds=timeout + 60,
    )


def _wait_terminal(driver: PandaStackDriver, handle: SandboxHandle, limit: float = 60) -> Any:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        result = asyncio.run(driver.get_status(handle))
        if result.terminal:
            return result
        assert result.state is SandboxState.RUNNING
        time.sleep(0.2)
    raise AssertionError("workload did not end")


def test_launch_poll_succeed_terminate_idempotent(local_server: Any) -> None:
    driver = _driver(local_server)
    asyncio.run(driver.health_check())
    request = _request(["sh", "-c", "sleep 1; echo hello from $HOSTNAME"])
    handle = asyncio.run(driver.launch(request))
    driver.validate_handle(handle, request_id=request.request_id)
    sb = local_server.client().sandboxes.get(handle.display_name)
    assert sb.metadata[REQUEST_LABEL] == request.request_id
    assert sb.metadata["job_engine"] == "airflow-executor"
    assert asyncio.run(driver.get_status(handle)).state is SandboxState.RUNNING
    result = _wait_terminal(driver, handle)
    assert (result.state, result.exit_code) == (SandboxState.SUCCEEDED, 0)
    output = asyncio.run(driver.get_output(handle))
    assert output is not None and "hello from" in output.stdout and not output.truncated
    asyncio.run(driver.terminate(handle))
    asyncio.run(driver.terminate(handle))  # idempotent: already gone is fine
    assert asyncio.run(driver.get_status(handle)).state is SandboxState.GONE
    assert local_server.client().sandboxes.list() == []


def test_failure_reports_exit_code_and_output_tail(local_server: Any) -> None:
    driver = _driver(local_server)
    handle = asyncio.run(driver.launch(_request(["sh", "-c", "echo step one; echo boom >&2; exit 3"])))
    try:
        result = _wait_terminal(driver, handle)
        assert (result.state, result.exit_code) == (SandboxState.FAILED, 3)
        assert "exit code 3" in (result.message or "")
        output = asyncio.run(driver.get_output(handle))
        assert output is not None and "boom" in output.stderr and "step one" in output.stdout
    finally:
        asyncio.run(driver.terminate(handle))


def test_timeout_is_enforced_in_the_guest(local_server: Any) -> None:
    driver = _driver(local_server)
    handle = asyncio.run(driver.launch(_request(["sleep", "60"], timeout=1)))
    try:
        result = _wait_terminal(driver, handle, limit=30)
        assert result.state is SandboxState.FAILED
        assert "timeout" in (result.message or "")
    finally:
        asyncio.run(driver.terminate(handle))


def test_lost_sandbox_is_gone(local_server: Any) -> None:
    driver = _driver(local_server)
    handle = asyncio.run(driver.launch(_request(["sleep", "60"])))
    local_server.client().sandboxes.delete(handle.display_name)
    result = asyncio.run(driver.get_status(handle))
    assert result.state is SandboxState.GONE and "lost" in (result.message or "")
    assert asyncio.run(driver.get_output(handle)) is None


def test_fence_deletes_every_sandbox_of_the_request_only(local_server: Any) -> None:
    driver = _driver(local_server)
    client = local_server.client()
    request = _request(["sleep", "60"])
    handle = asyncio.run(driver.launch(request))
    # A second sandbox of the same try (a launch whose response was lost) and one of another try.
    twin = client.sandboxes.create(template="code-interpreter", metadata={REQUEST_LABEL: request.request_id})
    other = client.sandboxes.create(template="code-interpreter", metadata={REQUEST_LABEL: str(uuid.uuid4())})
    try:
        asyncio.run(driver.fence(request.request_id))
        left = {sb.id for sb in client.sandboxes.list()}
        assert handle.display_name not in left and twin.id not in left
        assert other.id in left
        asyncio.run(driver.fence(request.request_id))  # idempotent
        assert asyncio.run(driver.recover(request.request_id)) is None  # un-persisted: fenced, not adopted
    finally:
        client.sandboxes.delete(other.id)


def test_capacity_refusal_carries_retry_after(make_local_server: Any) -> None:
    server = make_local_server(max_sandboxes=1, pool_size=0)
    client = server.client()
    blocker = client.sandboxes.create(template="code-interpreter")
    driver = _driver(server, budget=0)
    request = _request(["true"])
    try:
        with pytest.raises(SandboxCapacityError) as refused:
            asyncio.run(driver.launch(request))
        assert refused.value.retry_after > 0
        assert [sb.id for sb in client.sandboxes.list()] == [blocker.id]
    finally:
        client.sandboxes.delete(blocker.id)


def test_unknown_template_is_a_launch_error_naming_it(local_server: Any) -> None:
    driver = _driver(local_server)
    request = SandboxLaunchRequest(
        request_id=str(uuid.uuid4()),
        command=("true",),
        env={},
        provider_config={"template": "no-such-template"},
        workdir=None,
        timeout_seconds=10,
        ttl_seconds=70,
    )
    with pytest.raises(SandboxLaunchError, match="template"):
        asyncio.run(driver.launch(request))


def test_no_pandastack_key_in_the_sandbox(local_server: Any) -> None:
    """Search the running workload's environment and the sandbox's files for the key."""
    driver = _driver(local_server)
    key = local_server.api_key
    handle = asyncio.run(driver.launch(_request(["sleep", "30"], env={"VISIBLE_MARKER": "marker-7"})))
    try:
        sb = local_server.client().sandboxes.get(handle.display_name)
        # The launch returns once the workload is started in the background: on a loaded machine
        # it may not run yet. Polled until it does (the search must see the workload's env).
        environ, deadline = "", time.monotonic() + 60
        while "VISIBLE_MARKER=marker-7" not in environ and time.monotonic() < deadline:
            environ = sb.exec(
                "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'", timeout_seconds=30
            ).stdout
            time.sleep(0.2)
        assert "VISIBLE_MARKER=marker-7" in environ  # the search does see the workload's env
        assert key not in environ and "PANDASTACK" not in environ
        found = sb.exec(
            f"grep -rIl --exclude-dir=proc --exclude-dir=sys --exclude-dir=usr -e {key} / 2>/dev/null; true",
            timeout_seconds=120,
        ).stdout
        assert found.strip() == ""
    finally:
        asyncio.run(driver.terminate(handle))


# -- value objects --------------------------------------------------------------------------------


def test_validate_handle_rejects_foreign_handles(local_server: Any) -> None:
    driver = _driver(local_server)
    with pytest.raises(SandboxInvalidHandleError):
        driver.validate_handle(SandboxHandle({"pod": "x"}), request_id=str(uuid.uuid4()))


def test_execution_ref_round_trip_and_junk() -> None:
    rid = str(uuid.uuid4())
    ref = SandboxExecutionRef("pandastack", rid, SandboxHandle({"sandbox_id": "s", "started_at": 1.0}, "s"))
    encoded = ref.encode()
    assert SandboxExecutionRef.decode(encoded, expected_driver="pandastack") == ref
    assert SandboxExecutionRef.decode(encoded, expected_driver="islo") is None
    for junk in (None, rid, "sandbox:v1:!!!", "sandbox:v1:" + "A" * 10_000, 42):
        assert SandboxExecutionRef.decode(junk) is None


def test_request_needs_the_preassigned_uuid() -> None:
    with pytest.raises(SandboxConfigurationError, match="request_id"):
        _request(["true"], rid="not-a-uuid")
