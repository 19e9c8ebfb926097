"""Chunks (several queue messages in one sandbox) against the in-memory PandaStack.

The grouping rules (one isolation key and one set of job options per chunk, a
keyless or redelivered message alone), the per-mate rails (own directory, own
timeout, own result) and the chunk's death (unfinished mates released, never
blamed). The same rules on the real brokers are in tests/queue/test_chunks.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pandastack
import pytest

from pandastack_jobs import ConnectionConfig, FailureKind, JobKey, JobSpec
from pandastack_jobs.lifecycle import reap_before
from pandastack_jobs.queue import Consumer, parse
from pandastack_jobs.queue.chunks import (
    group_of,
    isolation_key,
    mate_label,
    mate_workdir,
    plan,
    reap_chunks_before,
    rebase,
    run_chunk,
)
from pandastack_jobs.queue.memory import MemoryTransport
from pandastack_jobs.testing import FakeClient, FakeSandbox, Script


def job(tenant: str | None = None, mid: str = "m", **options: Any) -> Any:
    doc: dict[str, Any] = {"id": mid, "command": "run"}
    if tenant is not None:
        doc["tenant"] = tenant
    if options:
        doc["options"] = options
    return parse(json.dumps(doc).encode(), mid)


# -- grouping ------------------------------------------------------------------------------------


def test_plan_fills_chunks_per_group_in_arrival_order_up_to_size_and_slots() -> None:
    items = ["a1", "b1", "a2", "a3", "x1", "b2", "a4", "x2"]

    def group(item: str) -> str | None:
        return None if item.startswith("x") else item[0]

    assert plan(items, group, 2, 10) == [["a1", "a2"], ["b1", "b2"], ["a3", "a4"], ["x1"], ["x2"]]
    assert plan(items, group, 8, 10) == [["a1", "a2", "a3", "a4"], ["b1", "b2"], ["x1"], ["x2"]]
    assert plan(items, group, 8, 2) == [["a1", "a2", "a3", "a4"], ["b1", "b2"]]  # the rest waits
    assert plan(items, group, 1, 3) == [["a1"], ["b1"], ["a2"]]


def test_only_one_key_and_one_set_of_options_share_a_group() -> None:
    a, a2, b = job("acme"), job("acme", "m2"), job("globex")
    assert group_of(a, "tenant", False) == group_of(a2, "tenant", False)
    assert group_of(a, "tenant", False) != group_of(b, "tenant", False)
    for other in (job("acme", template="base"), job("acme", timeout=5), job("acme", env={"A": "1"})):
        assert group_of(other, "tenant", False) != group_of(a, "tenant", False)
    # no key: alone, unless the user says keyless messages may share
    assert group_of(job(), "tenant", False) is None
    assert group_of(job(), "tenant", True) == group_of(job(mid="z"), "tenant", True)
    assert group_of(job(), "tenant", True) != group_of(a, "tenant", True)


def test_the_key_can_be_a_string_field_of_the_input() -> None:
    doc = {"command": "run", "input": {"customer": "c7", "n": 3, "obj": {"x": 1}}}
    j = parse(json.dumps(doc).encode(), "m")
    assert isolation_key(j, "input.customer") == "c7"
    assert isolation_key(j, "input.n") is None  # only a non-empty string is a key
    assert isolation_key(j, "input.obj") is None
    assert isolation_key(j, "input.missing") is None
    with pytest.raises(ValueError, match="chunk key"):
        Consumer(MemoryTransport(), chunk_key="options.template", chunk_size=2)
    with pytest.raises(ValueError, match="max_deliveries"):
        Consumer(MemoryTransport(), chunk_size=2, max_deliveries=1)


def test_rebase_moves_every_work_path_under_the_mates_directory() -> None:
    spec = JobSpec(command="run", files={"a.py": "1", "/etc/x": "2"}, collect=["out.txt"], input={"n": 1})
    moved = rebase(spec, mate_workdir(3))
    assert set(moved.files) == {"/work/.chunk/3/a.py", "/etc/x"}
    assert moved.result_path == "/work/.chunk/3/result.json"
    assert moved.collect == ("/work/.chunk/3/out.txt",)
    # what an earlier mate left at this mate's result and collected paths is removed first
    assert moved.command == "rm -rf -- /work/.chunk/3/result.json /work/.chunk/3/out.txt && run"
    given = rebase(JobSpec(command="run", files={"out.txt": "x"}, collect=["out.txt"]), "/w/1")
    assert given.command == "rm -rf -- /w/1/result.json && run"  # a delivered file is kept


# -- one chunk -------------------------------------------------------------------------------------


def specs(n: int, timeout: float = 10, **kw: Any) -> list[JobSpec]:
    return [
        JobSpec(
            command=f"job{i}",
            input={"i": i},
            key=JobKey(engine="queue", workflow="q", task="message", run=f"m{i}"),
            timeout=timeout,
            **kw,
        )
        for i in range(n)
    ]


def test_mates_share_one_sandbox_each_with_its_directory_timeout_and_result(fake: FakeClient) -> None:
    for i in range(3):
        fake.script(f"job{i}", result={"mate": i})
    out = run_chunk(fake, specs(3))
    assert [o.ok for o in out] == [True, True, True]
    assert [o.result for o in out] == [{"mate": 0}, {"mate": 1}, {"mate": 2}]
    assert len({o.sandbox_id for o in out}) == 1
    assert sum(1 for r in fake.requests if r[0] == "POST" and r[1] == "/sandboxes") == 1
    assert fake.live() == []  # deleted at the end
    for i, call in enumerate(fake.execs):
        assert call.env["JOB_WORKDIR"] == f"/work/.chunk/{i}"
        assert call.env["JOB_RESULT"] == f"/work/.chunk/{i}/result.json"
        assert call.env["JOB_INPUT"] == f"/work/.chunk/{i}/input.json"
        assert call.timeout == 10 and f"cd /work/.chunk/{i}" in call.line


def test_a_failing_mate_fails_alone(fake: FakeClient) -> None:
    fake.script("job0", result={"ok": 0})
    fake.script("job1", exit_code=3, stderr="bad row\n")
    fake.script("job2", hangs=True)
    fake.script("job3", raw_result=b"{not json")
    fake.script("job4", result={"ok": 4})
    seen: list[int] = []
    out = run_chunk(fake, specs(5, timeout=0.1, max_result_bytes=64), on_finished=lambda i, o: seen.append(i))
    assert [o.ok for o in out] == [True, False, False, False, True]
    assert out[1].kind is FailureKind.EXIT_CODE and "bad row" in out[1].reason
    assert out[2].kind is FailureKind.TIMEOUT
    assert out[3].kind is FailureKind.RESULT_INVALID
    assert out[4].result == {"ok": 4}
    assert seen == [0, 1, 2, 3, 4] and fake.live() == []


def test_a_result_over_the_cap_fails_only_its_mate(fake: FakeClient) -> None:
    fake.script("job0", result={"big": "x" * 200})
    fake.script("job1", result={"ok": 1})
    out = run_chunk(fake, specs(2, max_result_bytes=64))
    assert out[0].kind is FailureKind.RESULT_TOO_LARGE and out[1].ok


def test_when_the_sandbox_dies_the_unfinished_mates_are_released_not_blamed(fake: FakeClient) -> None:
    def die(sb: FakeSandbox, call: object) -> Script:
        fake.expire(sb.id)  # the OOM killer, the TTL, an operator
        return Script(exit_code=137)

    fake.script("job0", result={"ok": 0})
    fake.script("job1", action=die)
    out = run_chunk(fake, specs(4))
    assert out[0].ok
    assert [o.kind for o in out[1:]] == [FailureKind.SANDBOX_LOST] * 3
    assert all(o.redeliver for o in out[1:])
    assert "died while mate 2/4 ran" in out[3].reason
    assert len(fake.execs) == 2  # mates 3 and 4 never ran


def test_the_first_mates_next_delivery_reaps_a_chunk_a_killed_worker_left(fake: FakeClient) -> None:
    """The chunk's sandbox carries the first mate's job key: that message's redelivery (try 2)
    deletes it before creating its own, as for a lone message."""
    seen: list[dict[str, str]] = []
    fake.script("job1", action=lambda sb, call: seen.append(dict(sb.metadata)))  # type: ignore[func-returns-value]
    run_chunk(fake, specs(3))
    (meta,) = seen
    first = specs(1)[0]
    assert first.key is not None and meta["job_id"] == first.key.job_id and meta["job_try"] == "1"
    assert meta["queue_chunk_size"] == "3"
    orphan = fake.add_sandbox(metadata=meta)  # what a SIGKILLed worker's chunk leaves
    assert reap_before(fake, replace(first, key=replace(first.key, try_number=2))) == [orphan.id]


def test_a_later_mates_redelivery_reaps_only_earlier_chunks_it_was_a_mate_of(
    fake: FakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    """A mate that was not first finds the chunk by its own label: earlier tries (or an
    unreadable one) are deleted, its current and later tries and other jobs' chunks are not;
    a server that cannot be asked never stops the delivery."""
    key = specs(2)[1].key
    assert key is not None
    label = mate_label(key)
    earlier = fake.add_sandbox(metadata={label: "1"})
    unreadable = fake.add_sandbox(metadata={label: "x"})
    same_try = fake.add_sandbox(metadata={label: "2"})
    other = fake.add_sandbox(metadata={mate_label(replace(key, run="other")): "1"})
    spec = replace(specs(2)[1], key=replace(key, try_number=2))
    assert reap_chunks_before(fake, replace(spec, key=key)) == []  # a first delivery looks for nothing
    assert sorted(reap_chunks_before(fake, spec)) == sorted([earlier.id, unreadable.id])
    assert sorted(fake.live()) == sorted([same_try.id, other.id])
    fake.fail("list", pandastack.ServerError("down"))
    assert reap_chunks_before(fake, spec) == []
    assert "could not look for chunk sandboxes of earlier deliveries" in caplog.text


def test_a_create_failure_is_every_mates_failure(fake: FakeClient) -> None:
    fake.refuse_capacity(times=1, retry_after=7)
    out = run_chunk(fake, specs(3))
    assert [o.kind for o in out] == [FailureKind.CAPACITY] * 3
    assert [o.job_id for o in out] == [s.key.job_id for s in specs(3) if s.key]
    assert fake.live() == [] and fake.execs == []


# -- the consumer ----------------------------------------------------------------------------------


class _Fake(ConnectionConfig):
    def __init__(self, client: FakeClient) -> None:
        object.__setattr__(self, "_fake", client)

    def client(self) -> Any:
        return self._fake  # type: ignore[attr-defined]


def consume(fake: FakeClient, t: MemoryTransport, until: Callable[[Any], bool], **kw: Any) -> Any:
    kw.setdefault("release_delay", 0)
    kw.setdefault("poll_seconds", 0.05)
    c = Consumer(t, _Fake(fake), **kw)
    thread = threading.Thread(target=c.run, args=(until,), daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), c.stats
    return c.stats


def test_the_consumer_never_mixes_keys_and_each_mate_is_settled_alone(fake: FakeClient) -> None:
    t = MemoryTransport()
    fake.script("fail", exit_code=2, stderr="boom\n")
    fake.script(lambda cmd: "echo" in cmd, result={"fine": True})
    for i in range(12):
        tenant = ("acme", "globex", None)[i % 3]
        body = {"id": f"m{i}", "command": "fail" if i == 4 else f"echo {i}"}
        if tenant:
            body["tenant"] = tenant
        t.put(body)
    stats = consume(
        fake, t, lambda s: len(t.acked) + len(t.dead) >= 12, chunk_size=3, concurrency=2, max_deliveries=2
    )
    assert sorted(t.acked) == sorted(f"m{i}" for i in range(12) if i != 4)
    assert [mid for mid, _ in t.dead] == ["m4"] and t.released == ["m4"]  # redelivered, then dead
    tenants = {f"m{i}": ("acme", "globex", None)[i % 3] for i in range(12)}
    by_sandbox: dict[str, set[Any]] = {}
    for r in t.replies:
        by_sandbox.setdefault(r["sandbox_id"], set()).add(tenants[r["id"]])
    assert all(len(ts) == 1 for ts in by_sandbox.values()), by_sandbox
    keyless = [sb for sb, ts in by_sandbox.items() if ts == {None}]
    assert len(keyless) == 4  # each keyless message alone
    assert stats.chunks >= 2 and stats.peak_sandboxes <= 2
    assert fake.live() == []


def test_a_dead_chunk_releases_its_unfinished_mates_and_they_come_back_alone(fake: FakeClient) -> None:
    t = MemoryTransport()
    died = threading.Event()

    def die(sb: FakeSandbox, call: object) -> Script:
        if not died.is_set():
            died.set()
            fake.expire(sb.id)
            return Script(exit_code=137)
        return Script(result={"second": True})

    fake.script(lambda cmd: "echo" in cmd, result={"fine": True})
    fake.script("oom", action=die)
    for i, cmd in enumerate(["echo 0", "oom", "echo 2", "echo 3"]):
        t.put({"id": f"m{i}", "command": cmd, "tenant": "acme"})
    stats = consume(fake, t, lambda s: len(t.acked) >= 4, chunk_size=4, concurrency=1, max_deliveries=2)
    assert sorted(t.released) == ["m1", "m2", "m3"] and t.dead == []
    assert sorted(t.acked) == ["m0", "m1", "m2", "m3"]
    first = {r["id"]: r["sandbox_id"] for r in t.replies}
    # the released mates ran alone on their second delivery: one sandbox each
    assert len({first["m1"], first["m2"], first["m3"]}) == 3 and first["m0"] not in (first["m1"],)
    assert stats.peak_sandboxes == 1 and fake.live() == []


def test_a_stop_releases_the_messages_waiting_for_a_slot_at_once(fake: FakeClient) -> None:
    """Concurrency 1, chunk size 4, three tenants: two messages wait for the slot; a stop gives
    them back at once while the running one drains and is acked."""
    t = MemoryTransport()
    gate = threading.Event()
    fake.script("slow", Script(wait=gate, result={"ok": True}))
    for i, tenant in enumerate(("acme", "globex", "initech")):
        t.put({"id": f"m{i}", "command": "slow" if i == 0 else "echo", "tenant": tenant})
    c = Consumer(t, _Fake(fake), concurrency=1, chunk_size=4, poll_seconds=0.05, drain_seconds=10)
    thread = threading.Thread(target=c.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not fake.execs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.stats.in_flight == 1 and c.stats.sandboxes == 1  # one running, two waiting
    c.stop()
    deadline = time.monotonic() + 10
    while len(t.released) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(t.released) == ["m1", "m2"] and t.acked == []  # released while m0 still runs
    gate.set()
    thread.join(10)
    assert not thread.is_alive()
    assert t.acked == ["m0"] and c.stats.released_on_drain == 2 and fake.live() == []
