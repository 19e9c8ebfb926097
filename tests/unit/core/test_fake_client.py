"""The public testing module's own contract: it speaks the SDK's wire, as the server does.

If the SDK's one private seam (``Client._request``) changes shape, the first test fails
instead of the fake silently answering a call the SDK no longer makes.
"""

from __future__ import annotations

import inspect

import pandastack
import pytest

from pandastack_jobs.testing import FakeClient


def test_the_fake_accepts_every_argument_the_sdks_request_takes() -> None:
    sdk = inspect.signature(pandastack.Client._request).parameters
    fake = inspect.signature(FakeClient._request).parameters
    assert list(fake) == list(sdk)
    assert isinstance(FakeClient(), pandastack.Client)


def test_errors_are_the_sdks_classes_with_the_servers_messages(fake: FakeClient) -> None:
    with pytest.raises(pandastack.NotFoundError, match="not found"):
        fake.sandboxes.get("nope")
    sb = fake.sandboxes.create(template="base", ttl_seconds=10, metadata={"a": "b"})
    with pytest.raises(pandastack.NotFoundError, match="file does not exist"):
        sb.filesystem.stat("/work/none")
    with pytest.raises(pandastack.ServerError, match="no such file"):
        sb.filesystem.read("/work/none")
    with pytest.raises(pandastack.BadRequestError, match="absolute"):
        sb.filesystem.write("rel.txt", b"x")
    with pytest.raises(pandastack.BadRequestError, match="metadata"):
        fake.sandboxes.create(metadata={"a": 1})  # type: ignore[dict-item]
    with pytest.raises(pandastack.ServerError, match='template "x" is not on this host'):
        fake.sandboxes.create(template="x")
    with pytest.raises(pandastack.AuthError, match="PANDASTACK_API_KEY is required"):
        FakeClient(api_key=None).sandboxes.list()


def test_the_sdk_objects_are_real_and_round_trip(fake: FakeClient) -> None:
    sb = fake.sandboxes.create(template="base", ttl_seconds=10, metadata={"a": "b"})
    assert isinstance(sb, pandastack.Sandbox) and sb.template == "base" and sb.metadata == {"a": "b"}
    sb.filesystem.write("/work/d/x.txt", "hi")
    assert sb.filesystem.read("/work/d/x.txt") == b"hi"
    assert [e.name for e in sb.filesystem.listdir("/work")] == ["d"]
    info = sb.filesystem.stat("/work/d/x.txt")
    assert (info.size, info.is_dir, info.mode) == (2, False, "f")
    assert sb.filesystem.stat("/work/d").is_dir
    fake.script("echo", stdout="a\n", exit_code=2)
    assert sb.exec("echo").exit_code == 2 and sb.exec("echo").stdout == "a\n"
    assert [s.id for s in fake.sandboxes.list()] == [sb.id]
    sb.set_ttl(99)
    assert fake.sandbox(sb.id).ttl_seconds == 99
    child = fake.sandboxes.fork(sb.id, metadata={"ignored": "yes"})
    assert fake.sandbox(child.id).metadata == {"forked_from": sb.id}  # as the server: SDK metadata dropped
    assert fake.sandbox(child.id).files == fake.sandbox(sb.id).files
    sb.kill()
    assert fake.live() == [child.id]


def test_the_sdks_own_wrapping_applies_to_injected_errors(fake: FakeClient) -> None:
    sb = fake.sandboxes.create()
    fake.fail("exec", pandastack.ServerError("context deadline exceeded"))
    with pytest.raises(pandastack.SandboxTimeout):  # the SDK maps a 5xx naming a timeout
        sb.exec("x")
    fake.script("x", stdout="partial", stream_ends="eof")
    with pytest.raises(pandastack.ExecInterrupted) as caught:
        sb.exec_stream("x")
    assert caught.value.partial_stdout == "partial"


def test_injected_failures_count_down_and_match_their_target(fake: FakeClient) -> None:
    a, b = fake.sandboxes.create(), fake.sandboxes.create()
    fake.fail("get", pandastack.ServerError("flaky"), match=a.id, times=2)
    assert fake.sandboxes.get(b.id).id == b.id
    for _ in range(2):
        with pytest.raises(pandastack.ServerError):
            fake.sandboxes.get(a.id)
    assert fake.sandboxes.get(a.id).id == a.id


def test_only_sdk_errors_and_known_operations_can_be_injected(fake: FakeClient) -> None:
    with pytest.raises(TypeError, match="not an SDK error"):
        fake.fail("exec", RuntimeError("x"))
    with pytest.raises(ValueError, match="op"):
        fake.fail("reboot", pandastack.ServerError("x"))


def test_capacity_is_refused_past_max_sandboxes() -> None:
    fake = FakeClient(max_sandboxes=1)
    fake.sandboxes.create()
    with pytest.raises(pandastack.ServerError, match="no compute capacity"):
        fake.sandboxes.create()


def test_a_set_cancel_event_stops_the_create(fake: FakeClient) -> None:
    import threading

    event = threading.Event()
    event.set()
    with pytest.raises(pandastack.CreateCancelled):
        fake.sandboxes.create(cancel=event)
    assert fake.live() == []
