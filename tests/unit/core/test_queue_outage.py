"""The consumer against the in-memory PandaStack: a platform outage is not charged to the messages
(issue 33), every dead letter gets one log line naming both ids, and a stop says it drains (issue
36). The same outage on the real brokers and server is tests/queue/test_outage.py."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pandastack
import pytest

from pandastack_jobs.queue import Consumer
from pandastack_jobs.queue.consumer import MAX_UNCHARGED
from pandastack_jobs.queue.memory import MemoryTransport as _Memory
from pandastack_jobs.queue.outage import Backoff, Uncharged, platform_failure
from pandastack_jobs.testing import FakeClient
from pandastack_local.testing.waiting import wait_for
from tests.unit.core.test_queue_chunks import _Fake


def _start(fake: FakeClient, t: _Memory, **kw: Any) -> tuple[Consumer, threading.Thread]:
    kw.setdefault("release_delay", 0)
    kw.setdefault("poll_seconds", 0.05)
    c = Consumer(t, _Fake(fake), api_backoff=Backoff(first=0.05, cap=0.2), **kw)
    thread = threading.Thread(target=c.run, daemon=True)
    thread.start()
    return c, thread


def _stop(c: Consumer, thread: threading.Thread) -> None:
    c.stop()
    thread.join(30)
    assert not thread.is_alive(), c.stats


def _dead_letter(fake: FakeClient, t: _Memory, timeout: float) -> tuple[Consumer, Any]:
    """Consume ``t`` (two deliveries at most) until its one message is dead-lettered: the consumer
    and that dead letter's ``(message id, reason)``."""
    c, thread = _start(fake, t, max_deliveries=2)
    try:
        wait_for("the dead letter", lambda: t.dead, timeout=timeout, interval=0.01)
    finally:
        _stop(c, thread)
    (dead,) = t.dead
    return c, dead


def test_an_outage_is_never_charged_and_the_messages_run_after_it(
    fake: FakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pandastack_jobs")
    t = _Memory()  # like SQS: a delivery count the consumer cannot take back
    fake.script("echo", result={"fine": True})
    fake.fail("create", pandastack.APIConnectionError("Connection refused"), times=None)
    fake.fail("me", pandastack.APIConnectionError("Connection refused"), times=None)
    for i in range(3):
        t.put({"id": f"m{i}", "command": f"echo {i}"})
    # max_deliveries=1: any charged failure would dead-letter at once.
    c, thread = _start(fake, t, concurrency=2, max_deliveries=1)
    try:
        wait_for("the pause", lambda: c.stats.api_down_since, timeout=10, interval=0.01)
        assert "PandaStack unreachable since" in c.stats.line() and "pulling paused" in c.stats.line()
        wait_for(
            "two failed probes",
            lambda: caplog.text.count("still unreachable"),
            timeout=10,
            check=lambda n: n >= 2,
        )
        received = c.stats.received
        assert t.dead == [] and t.acked == []
        assert c.stats.received == received  # paused: nothing pulled since
        fake.heal()
        wait_for("all acked", lambda: len(t.acked), timeout=10, interval=0.01, check=lambda n: n == 3)
    finally:
        _stop(c, thread)
    assert t.dead == [] and sorted(t.acked) == ["m0", "m1", "m2"]
    assert max(t.counts.values()) >= 2  # delivered more often than max_deliveries, never dead-lettered
    assert c.stats.uncharged >= 1 and c.stats.api_down_since is None
    assert "pulling resumed" in caplog.text


def test_job_failures_still_count(fake: FakeClient) -> None:
    t = _Memory()
    fake.script("fail", exit_code=1, stderr="boom\n")
    t.put({"id": "bad", "command": "fail"})
    c, (mid, why) = _dead_letter(fake, t, timeout=10)
    assert mid == "bad" and why.kind == "exit_code" and why.deliveries == 2
    assert c.stats.api_down_since is None and c.stats.uncharged == 0


def test_a_message_the_api_chokes_on_alone_is_counted_after_ten_outages(fake: FakeClient) -> None:
    """A 5xx at the create for one message while the API answers the probes: its first
    MAX_UNCHARGED deliveries are not counted, then they are, and it is dead-lettered (it cannot
    hold the consumer in a pause-resume loop for ever)."""
    t = _Memory()
    fake.fail("create", pandastack.ServerError("internal error"), times=None)
    t.put({"id": "choke", "command": "echo 1"})
    c, (mid, why) = _dead_letter(fake, t, timeout=20)
    assert mid == "choke" and why.kind == "server_error" and why.deliveries == 2
    assert t.counts["choke"] == MAX_UNCHARGED + 2 and c.stats.uncharged == MAX_UNCHARGED


def test_a_request_only_others_fit_is_counted_and_pauses_no_one(
    fake: FakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    """Red team (issue 33): one message whose create the platform refuses for capacity every time
    (a template bigger than the room there is) while other messages' creates go through. It was
    taken for the platform being full: uncharged MAX_UNCHARGED times, and each refusal paused
    pulling for every tenant. Now, once another create went through since its last refusal, its
    refusals count toward max_deliveries and pause no one. Seen failing before: it was delivered
    MAX_UNCHARGED + 3 times and pulling was paused at each."""
    caplog.set_level(logging.INFO, logger="pandastack_jobs")
    t = _Memory()
    refusal = pandastack.ServerError("insufficient host memory for sandbox: need 4096 MB, 900 MB free")
    refusal.fake_status = 507  # type: ignore[attr-defined]
    refusal.fake_wire_retry_after = 0.05  # type: ignore[attr-defined]
    fake.fail("create", refusal, match="big", times=None)
    fake.script("echo", result={"fine": True})
    t.put({"id": "small-0", "command": "echo 0", "tenant": "others"})
    t.put({"id": "big", "command": "echo big", "tenant": "greedy", "options": {"template": "big"}})
    smalls = [f"small-{i}" for i in range(12)]
    for i in range(1, 12):
        t.put({"id": smalls[i], "command": f"echo {i}", "tenant": "others"})
    c, thread = _start(fake, t, concurrency=2, max_deliveries=3)
    try:
        wait_for("the dead letter", lambda: t.dead, timeout=20, interval=0.01)
        wait_for("the others acked", lambda: len(t.acked), timeout=20, interval=0.01, check=lambda n: n == 12)
    finally:
        _stop(c, thread)
    assert t.counts["big"] <= 4, t.counts  # at most its first refusal went uncounted
    assert caplog.text.count("pulling paused") <= 1, caplog.text
    ((mid, why),) = t.dead
    assert mid == "big" and why.kind == "capacity" and why.deliveries == 3, why
    assert "other messages' creates went through" in why.reason and "insufficient host memory" in why.reason
    assert sorted(t.acked) == sorted(smalls)


def test_every_dead_letter_gets_one_log_line_naming_both_ids(
    fake: FakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pandastack_jobs")
    t = _Memory()
    fake.script("perm", exit_code=7, stderr="cannot parse row 3\n")
    t.send(b'{"id": "corr-1", "command": "perm", "options": {"permanent_exit_codes": [7]}}', "broker-1")
    t.send(b"{not json", "broker-2")
    c, thread = _start(fake, t)
    try:
        wait_for("two dead letters", lambda: len(t.dead), timeout=10, interval=0.01, check=lambda n: n == 2)
    finally:
        _stop(c, thread)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dead-lettered:")]
    assert len(lines) == 2, lines
    perm = next(line for line in lines if "broker_id=broker-1" in line)
    assert "id=corr-1" in perm and "kind=permanent_exit_code" in perm and "cannot parse row 3" in perm
    bad = next(line for line in lines if "broker_id=broker-2" in line)
    assert "id=- " in bad and "kind=malformed" in bad
    assert any(r.getMessage().startswith("stopping: draining 0 job(s)") for r in caplog.records)
    assert any(r.getMessage().startswith("drained:") for r in caplog.records)


def test_what_counts_as_the_platforms_failure() -> None:
    from pandastack_jobs import FailureKind, JobOutcome

    def outcome(kind: FailureKind, sandbox_id: str | None = None) -> JobOutcome:
        return JobOutcome(ok=False, kind=kind, sandbox_id=sandbox_id)

    assert platform_failure(outcome(FailureKind.CONNECTION))
    assert platform_failure(outcome(FailureKind.CAPACITY))
    assert platform_failure(outcome(FailureKind.SERVER_ERROR))  # at the create: no sandbox
    assert not platform_failure(outcome(FailureKind.SERVER_ERROR, "sb-1"))  # mid-job: charged once
    for kind in (
        FailureKind.EXIT_CODE,
        FailureKind.TIMEOUT,
        FailureKind.RESULT_INVALID,
        FailureKind.SANDBOX_LOST,
    ):
        assert not platform_failure(outcome(kind, "sb-1"))
    assert not platform_failure(JobOutcome(ok=True))


def test_the_uncharged_memory_is_bounded_and_never_below_one() -> None:
    u = Uncharged(limit=2)
    for mid in ("a", "a", "b", "c"):
        u.add(mid)
    assert u.get("a") == 0 and u.get("b") == 1 and u.get("c") == 1  # the oldest went first
    assert u.charged("b", 3) == 2 and u.charged("c", 1) == 1
    u.forget("b")
    assert u.charged("b", 3) == 3


def test_the_backoff_is_bounded_and_jittered() -> None:
    b = Backoff(first=1.0, cap=8.0)
    waits = [b.next() for _ in range(8)]
    assert all(0.5 <= w <= 8.0 for w in waits) and max(waits[4:]) <= 8.0 and min(waits[4:]) >= 4.0
    b.reset()
    assert 0.5 <= b.next() <= 1.0


def test_the_api_is_named_without_a_password_written_into_its_url(monkeypatch: pytest.MonkeyPatch) -> None:
    from pandastack_jobs import ConnectionConfig
    from pandastack_jobs.queue.outage import describe_api

    assert (
        describe_api(ConnectionConfig(api_url="http://ops:s3cret@10.0.0.5:8321"))
        == "http://***@10.0.0.5:8321"
    )
    monkeypatch.setenv("PANDASTACK_API", "http://127.0.0.1:8321")
    assert describe_api(ConnectionConfig()) == "http://127.0.0.1:8321 (PANDASTACK_API)"
