"""consume_queue: a Prefect flow on the real brokers of tests/queue, each message a task run."""

from __future__ import annotations

import json
from typing import Any

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from prefect_blocks import PandaStackCredentials
from prefect_blocks.queue import consume_queue
from tests.queue.batch import CONSUME, RESULTS, results, send_batch
from tests.queue.brokers import Broker


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
