"""``PandaStackDriver``: the executor's contract translated to the core's detached jobs, checked
through :class:`FakeClient` (the same driver against a real server: tests/airflow)."""

from __future__ import annotations

import asyncio
import uuid

import pandastack
import pytest

from airflow_provider.executors.driver import (
    REQUEST_LABEL,
    SANDBOX_ID_PATH,
    PandaStackDriver,
    SandboxLaunchError,
)
from airflow_provider.executors.models import (
    SandboxCapacityError,
    SandboxHandle,
    SandboxInvalidHandleError,
    SandboxLaunchRequest,
    SandboxState,
)
from pandastack_jobs import ConnectionConfig, DetachedJob, guest
from pandastack_jobs.testing import FAKE_KEY, FakeClient

LABELS = {"dag_id": "d", "task_id": "t", "run_id": "r", "map_index": "-1", "try_number": "2"}


@pytest.fixture
def driver(fake: FakeClient, monkeypatch: pytest.MonkeyPatch) -> PandaStackDriver:
    monkeypatch.setattr(ConnectionConfig, "client", lambda self: fake)
    return PandaStackDriver(ConnectionConfig(api_key=FAKE_KEY))


def request(
    argv: tuple[str, ...] = ("python", "-m", "task"),
    labels: dict[str, str] | None = None,
    template: str = "code-interpreter",
) -> SandboxLaunchRequest:
    return SandboxLaunchRequest(
        str(uuid.uuid4()),
        argv,
        {"TZ": "UTC"},
        provider_config={"template": template, "labels": labels or {}},
        workdir=None,
        timeout_seconds=60,
        ttl_seconds=120,
    )


def launch(driver: PandaStackDriver, req: SandboxLaunchRequest) -> SandboxHandle:
    return asyncio.run(driver.launch(req))


def test_launch_tags_the_sandbox_with_the_try_and_starts_the_argv_detached(
    driver: PandaStackDriver, fake: FakeClient
) -> None:
    req = request(("python", "-c", "print('a b')"), labels=LABELS)
    handle = launch(driver, req)
    job = DetachedJob.from_dict(dict(handle.data))
    sb = fake.sandbox(job.sandbox_id)
    assert sb.metadata[REQUEST_LABEL] == req.request_id and sb.metadata["job_try"] == "2"
    assert sb.metadata["job_engine"] == "airflow-executor" and sb.ttl_seconds == 120
    assert sb.files[SANDBOX_ID_PATH] == job.sandbox_id.encode()
    call = fake.execs[-1]
    assert (
        call.detached and call.command == "python -c 'print('\"'\"'a b'\"'\"')'" and call.env["TZ"] == "UTC"
    )
    assert FAKE_KEY not in call.line and handle.display_name == job.sandbox_id


def test_a_capacity_refusal_is_a_capacity_error_with_retry_after(
    driver: PandaStackDriver, fake: FakeClient
) -> None:
    fake.refuse_capacity(retry_after=None)
    with pytest.raises(SandboxCapacityError) as caught:
        launch(driver, request())
    assert caught.value.retry_after == 5.0 and fake.live() == []


def test_a_failed_start_is_a_launch_error_and_leaves_no_sandbox(
    driver: PandaStackDriver, fake: FakeClient
) -> None:
    fake.fail("exec", pandastack.ServerError("agent unreachable"))
    with pytest.raises(SandboxLaunchError, match="agent unreachable"):
        launch(driver, request())
    assert fake.live() == []


def test_status_follows_the_exit_marker(driver: PandaStackDriver, fake: FakeClient) -> None:
    fake.script("ok", runs_for=1)
    fake.script("bad", exit_code=3)
    ok, bad = launch(driver, request(("ok",))), launch(driver, request(("bad",)))
    status = lambda h: asyncio.run(driver.get_status(h))  # noqa: E731
    assert status(ok).state is SandboxState.RUNNING
    assert (status(ok).state, status(ok).exit_code) == (SandboxState.SUCCEEDED, 0)
    failed = status(bad)
    assert (
        failed.state is SandboxState.FAILED
        and failed.exit_code == 3
        and "exit code 3" in (failed.message or "")
    )
    fake.expire(DetachedJob.from_dict(dict(ok.data)).sandbox_id)
    assert status(ok).state is SandboxState.GONE


def test_past_the_deadline_without_an_exit_the_try_fails(driver: PandaStackDriver, fake: FakeClient) -> None:
    fake.script("hang", hangs=True)
    job = DetachedJob.from_dict(dict(launch(driver, request(("hang",))).data))
    late = SandboxHandle(DetachedJob(job.sandbox_id, job.started_at - 3600, job.timeout).to_dict())
    result = asyncio.run(driver.get_status(late))
    assert result.state is SandboxState.FAILED and "did not finish within its 60s" in (result.message or "")


def test_fence_deletes_every_sandbox_of_the_request_and_nothing_else(
    driver: PandaStackDriver, fake: FakeClient
) -> None:
    req = request()
    launch(driver, req)
    twin = fake.add_sandbox(metadata={REQUEST_LABEL: req.request_id})
    other = fake.add_sandbox(metadata={REQUEST_LABEL: str(uuid.uuid4())})
    asyncio.run(driver.fence(req.request_id))
    assert fake.live() == [other.id] and twin.id in fake.deleted


def test_a_fence_that_leaves_a_sandbox_raises_so_it_is_retried(
    driver: PandaStackDriver, fake: FakeClient
) -> None:
    req = request()
    launch(driver, req)
    fake.fail("delete", pandastack.ServerError("busy"))
    with pytest.raises(SandboxLaunchError, match="could not delete"):
        asyncio.run(driver.fence(req.request_id))
    asyncio.run(driver.fence(req.request_id))
    assert fake.live() == []


def test_list_requests_names_only_this_executors_tries(driver: PandaStackDriver, fake: FakeClient) -> None:
    req = request(labels=LABELS)
    launch(driver, req)
    fake.add_sandbox(metadata={REQUEST_LABEL: str(uuid.uuid4()), "job_engine": "airflow"})
    found = asyncio.run(driver.list_requests())
    assert found == {req.request_id: LABELS}


def test_read_file_is_bounded_and_none_when_absent(driver: PandaStackDriver, fake: FakeClient) -> None:
    handle = launch(driver, request())
    sb = fake.sandbox(DetachedJob.from_dict(dict(handle.data)).sandbox_id)
    sb.files["/work/logs/a.log"] = b"0123456789"
    assert asyncio.run(driver.read_file(handle, "/work/logs/a.log", 100)) == b"0123456789"
    fake.script("tail -c 4 /work/logs/a.log", stdout="6789")
    assert asyncio.run(driver.read_file(handle, "/work/logs/a.log", 4)) == b"6789"
    assert fake.execs[-1].line == "tail -c 4 /work/logs/a.log"  # only the tail crosses the wall
    assert asyncio.run(driver.read_file(handle, "/work/logs/none.log", 4)) is None


def test_output_is_the_bounded_redacted_tail(driver: PandaStackDriver, fake: FakeClient) -> None:
    handle = launch(driver, request())
    fake.script(f"tail -c 16384 {guest.DETACHED_STDOUT}", stdout=f"out {FAKE_KEY}\n", stderr="err\n99999\n")
    output = asyncio.run(driver.get_output(handle))
    assert output is not None and FAKE_KEY not in output.stdout and output.stderr == "err"
    assert output.truncated  # 99999 bytes written, 16 KiB shown


def test_a_handle_that_is_not_a_detached_job_is_refused(driver: PandaStackDriver) -> None:
    with pytest.raises(SandboxInvalidHandleError):
        driver.validate_handle(SandboxHandle({"sandbox": "x"}), request_id="r")
