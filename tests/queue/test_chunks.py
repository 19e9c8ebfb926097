"""Chunks on the real brokers and the real pandastack-local: up to K messages of one isolation key in
one sandbox, each acked, redelivered or dead-lettered on its own (docs/queues.md, "Chunks")."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import defaultdict
from typing import Any

import pytest

from e2e.brokers import Broker
from pandastack_jobs import function_job
from pandastack_local import LocalServer
from pandastack_local.testing.waiting import wait_for
from tests.queue.conftest import live_sandboxes, wait_results

pytestmark = pytest.mark.timeout(180)


def tenant_message(mid: str, tenant: str | None, pre: str = "", **options: Any) -> bytes:
    """A message whose job reports its id, tenant and delivery as its result."""
    report = (
        f'printf \'{{"id": "%s", "tenant": "{tenant or ""}", "delivery": %s, "dir": "%s"}}\' '
        '"$QUEUE_MESSAGE_ID" "$QUEUE_DELIVERY" "$PWD" > "$JOB_RESULT"'
    )
    doc: dict[str, Any] = {"id": mid, "command": f"{pre}{report}"}
    if tenant is not None:
        doc["tenant"] = tenant
    if options:
        doc["options"] = options
    return json.dumps(doc).encode()


class Peak:
    """Samples the live sandboxes of one queue while a consumer runs."""

    def __init__(self, server: LocalServer, queue: str) -> None:
        self.peak = 0
        self.error: Exception | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(server, queue), daemon=True)
        self._thread.start()

    def _run(self, server: LocalServer, queue: str) -> None:
        # An error is kept for stop(): a sampler that outlived its test (a slow listing under
        # load) once raised into a later test's run (the Kafka rebalance test, in CI).
        try:
            while not self._done.is_set():
                self.peak = max(self.peak, len(live_sandboxes(server, job_workflow=queue)))
                time.sleep(0.05)
        except Exception as exc:
            self.error = exc

    def stop(self) -> int:
        self._done.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "the sandbox sampler did not stop"
        if self.error is not None:
            raise self.error
        return self.peak


def test_a_chunk_acks_each_mate_and_never_mixes_keys(
    broker: Broker, queue: str, start_consumer: Any, local_server: LocalServer
) -> None:
    """Eleven messages, chunk size 4, concurrency 2: every mate gets its own result and ack; a mate
    that fails once is redelivered alone and then acked, a permanent failure is dead-lettered alone;
    no sandbox holds two tenants (or two option sets), keyless messages each get their own, and never
    more than 2 sandboxes live."""
    t = broker.transport(queue)
    flaky = '[ "$QUEUE_DELIVERY" -ge 2 ] || { echo flaky-once >&2; exit 1; }; '
    plan = [
        ("a0", "acme", "", {}),
        ("b0", "globex", "", {}),
        ("a1", "acme", flaky, {}),
        ("a2", "acme", "", {}),
        ("n0", None, "", {}),
        ("b1", "globex", "exit 7; ", {"permanent_exit_codes": [7]}),
        ("a3", "acme", "", {}),
        ("b2", "globex", "", {}),
        ("a4", "acme", "", {"timeout": 20}),  # other options: never with the other acme mates
        ("n1", None, "", {}),
        ("b3", "globex", "exit 7; ", {"permanent_exit_codes": [7]}),
    ]
    for mid, tenant, pre, options in plan:
        t.send(tenant_message(mid, tenant, pre, **options))
    peak = Peak(local_server, queue)
    stats = start_consumer(
        until=lambda s: s.acked + s.dead_lettered >= 11, concurrency=2, chunk_size=4, max_deliveries=3
    ).join(120)
    assert peak.stop() <= 2 and stats.peak_sandboxes <= 2

    results = {r["id"]: r for r in wait_results(broker, queue, 9)}
    assert sorted(results) == ["a0", "a1", "a2", "a3", "a4", "b0", "b2", "n0", "n1"]
    assert all(r["ok"] for r in results.values())
    dead = {json.loads(d["body"])["id"]: d["why"] for d in broker.dead(queue)}
    assert set(dead) == {"b1", "b3"} and all(w["kind"] == "permanent_exit_code" for w in dead.values())
    assert results["a1"]["result"]["delivery"] == 2 and stats.redelivered == 1

    by_sandbox: dict[str, list[str]] = defaultdict(list)
    for mid, r in results.items():
        assert r["result"]["id"] == mid and r["delivery"] == r["result"]["delivery"]
        by_sandbox[r["sandbox_id"]].append(mid)
    for mids in by_sandbox.values():
        assert len({results[m]["result"]["tenant"] for m in mids}) == 1, by_sandbox
    shared = [m for m in by_sandbox.values() if len(m) > 1]
    assert shared, by_sandbox  # chunks happened (how full depends on how the broker batches)
    for alone in ("n0", "n1", "a4", "a1"):  # keyless, other options, redelivered: alone
        assert by_sandbox[results[alone]["sandbox_id"]] == [alone], by_sandbox
    for mids in shared:
        dirs = [results[m]["result"]["dir"] for m in mids]
        assert len(set(dirs)) == len(dirs) and all(d.startswith("/work/.chunk/") for d in dirs), dirs
    assert stats.chunks >= 2 and broker.depth(queue) == 0
    assert live_sandboxes(local_server, job_workflow=queue) == []


def test_a_sandbox_killed_mid_chunk_releases_its_unfinished_mates(
    broker: Broker, queue: str, start_consumer: Any, local_server: LocalServer
) -> None:
    """The chunk's sandbox is deleted while its second mate runs: the first mate's result stands
    (acked once), the running mate and the two not yet run are released, not dead-lettered, and
    each comes back alone and is acked; no sandbox is left."""
    t = broker.transport(queue)
    t.send(tenant_message("k0", "acme"))
    t.send(tenant_message("k1", "acme", '[ "$QUEUE_DELIVERY" -ge 2 ] || sleep 60; '))
    t.send(tenant_message("k2", "acme"))
    t.send(tenant_message("k3", "acme"))
    running = start_consumer(until=lambda s: s.acked >= 4, concurrency=1, chunk_size=4, max_deliveries=2)
    wait_results(broker, queue, 1)
    deadline = time.monotonic() + 30
    while not (live := live_sandboxes(local_server, job_workflow=queue)) and time.monotonic() < deadline:
        time.sleep(0.05)
    (sb,) = live  # the chunk's sandbox
    time.sleep(0.5)  # k1 is running in it now
    local_server.client().sandboxes.delete(sb.id)  # as the TTL or an OOM kill would end it
    stats = running.join(120)
    results = {r["id"]: r for r in broker.results(queue)}
    assert sorted(results) == ["k0", "k1", "k2", "k3"], results
    assert results["k0"]["sandbox_id"] == sb.id and results["k0"]["delivery"] == 1
    for mid in ("k1", "k2", "k3"):
        assert results[mid]["delivery"] == 2 and results[mid]["sandbox_id"] != sb.id
    assert len({results[m]["sandbox_id"] for m in ("k1", "k2", "k3")}) == 3  # alone, each
    assert broker.dead(queue) == [] and stats.redelivered == 3 and stats.dead_lettered == 0
    assert len(broker.results(queue)) == 4 and broker.depth(queue) == 0
    assert live_sandboxes(local_server, job_workflow=queue) == []


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_the_command_runs_chunks_and_refuses_a_chunk_it_could_not_release(
    broker: Broker, queue: str, spawn_worker: Any, local_server: LocalServer
) -> None:
    """``pandastack-jobs consume --chunk-size 4`` runs one tenant's four messages in one sandbox;
    ``--chunk-size 2 --max-deliveries 1`` is refused with the reason, before anything runs."""
    t = broker.transport(queue)
    for i in range(4):
        t.send(tenant_message(f"c{i}", "acme"))
    refused = spawn_worker("--chunk-size", "2", "--max-deliveries", "1")
    assert refused.wait(60) == 2
    assert "chunk_size > 1 needs max_deliveries >= 2" in refused.text() and "Traceback" not in refused.text()
    worker = spawn_worker("--chunk-size", "4")
    results = wait_results(broker, queue, 4)
    assert sorted(r["id"] for r in results) == ["c0", "c1", "c2", "c3"]
    assert len({r["sandbox_id"] for r in results}) == 1, results
    worker.signal(signal.SIGTERM)
    assert worker.wait(60) == 0, worker.text()
    assert live_sandboxes(local_server, job_workflow=queue) == []


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_a_mate_cannot_hand_the_next_mate_a_result(broker: Broker, queue: str, start_consumer: Any) -> None:
    """The first mate plants a result in the second mate's directory; the second exits 0 without
    writing one: it is dead-lettered as result_missing, never acked with the planted result."""
    t = broker.transport(queue)
    plant = "mkdir -p /work/.chunk/1 && printf '{\"forged\": true}' > /work/.chunk/1/result.json; "
    t.send(tenant_message("p0", "acme", plant))
    t.send(json.dumps({"id": "p1", "tenant": "acme", "command": "true"}).encode())
    stats = start_consumer(
        until=lambda s: s.acked + s.dead_lettered >= 2, concurrency=1, chunk_size=2, max_deliveries=2
    ).join(60)
    results = broker.results(queue)
    assert [r["id"] for r in results] == ["p0"] and stats.chunks == 1
    (dead,) = broker.dead(queue)
    assert json.loads(dead["body"])["id"] == "p1" and dead["why"]["kind"] == "result_missing", dead


@pytest.mark.parametrize("broker", ["redis", "postgres", "kafka"], indirect=True)
def test_a_worker_sigkilled_mid_chunk_leaves_nothing_behind(
    broker: Broker, queue: str, spawn_worker: Any, start_consumer: Any, local_server: LocalServer
) -> None:
    """``consume --chunk-size 4`` is SIGKILLed while the chunk's second mate runs, after the first
    was acked: a fresh consumer gets the three unacked mates back (delivery 2, each alone), the
    acked one never again, every result is delivered once, and the chunk's sandbox is reaped by
    the redelivered mates' keys (the first mate's key never comes back; the TTL is 90 s away)."""
    t = broker.transport(queue)
    t.send(tenant_message("s0", "acme"))
    t.send(tenant_message("s1", "acme", '[ "$QUEUE_DELIVERY" -ge 2 ] || sleep 60; '))
    t.send(tenant_message("s2", "acme"))
    t.send(tenant_message("s3", "acme"))
    t.close()
    worker = spawn_worker("--concurrency", "1", "--chunk-size", "4", "--max-deliveries", "3")
    wait_for("s0 acked", worker.text, timeout=60, interval=0.1, check=lambda text: " acked 1 " in text)
    (chunk,) = live_sandboxes(local_server, job_workflow=queue)  # s1 sleeps in it now
    assert chunk.metadata["queue_message_id"] == "s0" and chunk.metadata["queue_chunk_size"] == "4"
    worker.signal(signal.SIGKILL)
    worker.wait(10)
    assert [sb.id for sb in live_sandboxes(local_server, job_workflow=queue)] == [chunk.id]  # left behind

    stats = start_consumer(until=lambda s: s.acked >= 3, concurrency=2, chunk_size=4, max_deliveries=3).join(
        90
    )
    results = broker.results(queue)
    assert sorted(r["id"] for r in results) == ["s0", "s1", "s2", "s3"], results  # each once
    by_id = {r["id"]: r for r in results}
    assert by_id["s0"]["delivery"] == 1 and by_id["s0"]["sandbox_id"] == chunk.id
    for mid in ("s1", "s2", "s3"):
        assert by_id[mid]["result"]["delivery"] == 2 and by_id[mid]["sandbox_id"] != chunk.id
    assert stats.received == 3 and stats.acked == 3 and stats.dead_lettered == 0
    assert broker.dead(queue) == [] and broker.depth(queue) == 0
    assert live_sandboxes(local_server, job_workflow=queue) == []


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_a_timed_out_mate_leaves_nothing_running_for_the_next(
    broker: Broker, queue: str, start_consumer: Any
) -> None:
    """The first mate times out with a child deaf to TERM; the next mate, in the same sandbox,
    counts the processes left of it: none, the guest clock KILLed the group after the grace
    (t0 is then retried alone and dead-lettered)."""
    t = broker.transport(queue)
    deaf = "(trap '' TERM; exec sleep 1002) & sleep 600"
    count = (
        "n=0; for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null | grep -q 'sleep 100[2]' "
        "&& n=$((n+1)); done; "
        'printf \'{"id": "t1", "alive": %s, "dir": "%s"}\' $n "$PWD" > "$JOB_RESULT"'
    )
    t.send(json.dumps({"id": "t0", "tenant": "acme", "command": deaf, "options": {"timeout": 2}}).encode())
    t.send(json.dumps({"id": "t1", "tenant": "acme", "command": count, "options": {"timeout": 2}}).encode())
    start_consumer(
        until=lambda s: s.acked + s.dead_lettered >= 2, concurrency=1, chunk_size=2, max_deliveries=2
    ).join(90)
    (dead,) = broker.dead(queue)
    assert json.loads(dead["body"])["id"] == "t0" and dead["why"]["kind"] == "timeout", dead
    # The second mate of the chunk (its own directory), so in the sandbox t0 timed out in.
    assert [r["result"] for r in broker.results(queue)] == [{"id": "t1", "alive": 0, "dir": "/work/.chunk/1"}]


def _square(n: int, *, tag: str) -> dict:
    """A function job's body: where it ran and what it computed."""
    import os

    return {"n": n, "square": n * n, "tag": tag, "dir": os.getcwd()}


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_function_job_mates_run_in_a_chunk_on_their_first_delivery(
    broker: Broker, queue: str, start_consumer: Any
) -> None:
    """Eight messages built by ``function_job`` (what the Celery, Prefect and Airflow function paths
    send), chunk size 8: every mate runs its script from its own directory, reads its own input and
    writes its own result, so each is acked on delivery 1 with its own square; none is redelivered."""
    t = broker.transport(queue)
    for i in range(8):
        job = function_job(_square, [i], {"tag": f"f{i}"})
        doc = {"id": f"f{i}", "tenant": "acme", **{k: job[k] for k in ("command", "files", "input")}}
        t.send(json.dumps(doc).encode())
    stats = start_consumer(
        until=lambda s: s.acked + s.dead_lettered >= 8, concurrency=1, chunk_size=8, max_deliveries=3
    ).join(120)
    results = {r["id"]: r for r in wait_results(broker, queue, 8)}
    assert sorted(results) == [f"f{i}" for i in range(8)], results
    for i in range(8):
        r = results[f"f{i}"]
        assert r["ok"] and r["delivery"] == 1, r
        assert (r["result"]["n"], r["result"]["square"], r["result"]["tag"]) == (i, i * i, f"f{i}"), r
    assert stats.redelivered == 0 and stats.dead_lettered == 0 and broker.dead(queue) == []
    by_sandbox: dict[str, list[str]] = defaultdict(list)
    for mid, r in results.items():
        by_sandbox[r["sandbox_id"]].append(mid)
    shared = [mid for mids in by_sandbox.values() if len(mids) > 1 for mid in mids]
    assert shared and stats.chunks >= 1, by_sandbox  # mates did share a sandbox
    assert all(results[m]["result"]["dir"].startswith("/work/.chunk/") for m in shared), results
