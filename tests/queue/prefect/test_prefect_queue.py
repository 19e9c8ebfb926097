"""consume_queue: a Prefect flow on the real brokers of tests/queue, each message a task run."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from e2e.brokers import Broker
from prefect_blocks import PandaStackCredentials
from prefect_blocks.queue import consume_queue
from tests.queue.batch import (
    CHUNK_CONSUME,
    CHUNK_IDS,
    CONSUME,
    RESULTS,
    check_chunk_results,
    results,
    send_batch,
    send_chunk_batch,
)


async def _task_runs(flow_run_id: Any) -> list[Any]:
    async with get_client() as client:
        return await client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )


def test_each_message_is_a_task_run_acked_after_it_completed(
    local_server: Any,
    credentials: PandaStackCredentials,
    broker: Broker,
    queue: str,
) -> None:
    send_batch(broker, queue)
    state = consume_queue(broker=broker.url(queue), credentials=credentials, **CONSUME, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary["acked"] == 2 and summary["redelivered"] == 1 and summary["dead_lettered"] == 1, summary
    assert results(broker, queue) == RESULTS
    (dead,) = broker.dead(queue)
    assert json.loads(dead["body"])["id"] == "poison" and dead["why"]["kind"] == "permanent_exit_code"
    assert broker.depth(queue) == 0
    import anyio

    runs = anyio.run(_task_runs, state.state_details.flow_run_id)
    by_name = sorted((r.name, r.state.type.value) for r in runs)
    assert by_name == [
        ("message flaky #1", "FAILED"),
        ("message flaky #2", "COMPLETED"),
        ("message good #1", "COMPLETED"),
        ("message poison #1", "FAILED"),
    ], by_name
    assert local_server.client().sandboxes.list() == []


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_each_chunk_mate_is_its_own_task_run_acked_after_it_completed(
    local_server: Any,
    credentials: PandaStackCredentials,
    broker: Broker,
    queue: str,
) -> None:
    """With chunks, a mate is still its own task run with its own state: the failing mate's run
    fails alone (its chunk-mates complete) and its redelivery is a run of its own; each mate's
    result is written after its own task run ended (the ack follows the result), and the first
    mate's before the chunk's last mate ended (settled as each ends, not with the chunk)."""
    send_chunk_batch(broker, queue)
    state = consume_queue(
        broker=broker.url(queue), credentials=credentials, **CHUNK_CONSUME, return_state=True
    )
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary["acked"] == 6 and summary["redelivered"] == 1 and summary["dead_lettered"] == 0, summary
    replies = check_chunk_results(broker, queue)
    import anyio

    runs = anyio.run(_task_runs, state.state_details.flow_run_id)
    by_name = {r.name: r for r in runs}
    expected = {f"message {m} #1": "COMPLETED" for m in CHUNK_IDS}
    expected |= {"message a1 #1": "FAILED", "message a1 #2": "COMPLETED"}
    assert sorted((n, r.state.type.value) for n, r in by_name.items()) == sorted(expected.items())
    # Redis stream ids are the broker's clock in ms: when each result was written.
    stream = broker.r.xrange(f"{queue}:results")
    written = {json.loads(f[b"body"])["id"]: int(i.split(b"-")[0]) for i, f in stream}
    for mid, reply in replies.items():
        run = by_name[f"message {mid} #{reply['delivery']}"]
        assert int(run.end_time.timestamp() * 1000) <= written[mid], (mid, run.end_time, written[mid])
    assert written["a0"] < by_name["message a2 #1"].end_time.timestamp() * 1000
    assert local_server.client().sandboxes.list() == []
