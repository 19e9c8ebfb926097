"""Capacity refusals as delayed redelivery, the global concurrency cap, and the sweep hook."""

from __future__ import annotations

import re
import threading
import time

from prefect import flow, unmapped
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.futures import wait

from prefect_blocks import PandaStackCredentials, run_in_sandbox, sandbox_cleanup_hook
from prefect_blocks.keys import flow_run_key
from tests.support.metrics import scrape, value
from tests.support.prefect_readback import flow_run_id, logs, task_runs


def test_capacity_refusal_is_redelivered_no_sooner_than_retry_after(make_local_server) -> None:
    server = make_local_server(max_sandboxes=1)
    client = server.client()
    blocker = client.sandboxes.create(ttl_seconds=60)
    creds = PandaStackCredentials(api_url=server.url, api_key=server.api_key, max_create_retry_seconds=0)

    def free_after_the_refusal() -> None:
        """Delete the blocker once the task's create was refused (not after a fixed time: on a
        loaded host the flow may start later than any timer, and its first create then fits)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if value(
                scrape(server.url, server.api_key), "pandastack_local_refusals_total", reason="count_cap"
            ):
                break
            time.sleep(0.05)
        client.sandboxes.delete(blocker.id)

    freed = threading.Thread(target=free_after_the_refusal, daemon=True)

    @flow
    def busy_flow() -> object:
        freed.start()
        return run_in_sandbox.with_options(retries=1)(
            command="echo '[1]' > /work/result.json", credentials=creds, timeout=30
        )

    try:
        state = busy_flow(return_state=True)
    finally:
        freed.join()
    assert state.is_completed(), state.message
    assert task_runs(flow_run_id(state))[0].run_count == 2
    text = logs(flow_run_id(state))
    minimum = float(re.search(r"redeliverable after at least ([0-9.]+)s", text).group(1))
    waited = float(re.search(r"redelivering in a fresh sandbox after ([0-9.]+)s", text).group(1))
    assert waited >= minimum > 0
    assert client.sandboxes.list() == []


def test_global_concurrency_limit_caps_live_sandboxes(credentials, ps_client) -> None:
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(
            GlobalConcurrencyLimitCreate(name="pandastack-sandboxes", limit=2)
        )
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], len(ps_client.sandboxes.list()))
            time.sleep(0.05)

    @flow
    def capped_flow() -> None:
        futures = run_in_sandbox.map(
            command=unmapped("sleep 1; echo '{}' > /work/result.json"),
            input=list(range(5)),
            credentials=unmapped(credentials),
            concurrency_limit=unmapped("pandastack-sandboxes"),
            timeout=unmapped(30),
        )
        wait(futures)
        assert all(f.state.is_completed() for f in futures)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        capped_flow()
    finally:
        stop.set()
        watcher.join()
    assert peak[0] == 2, peak


def test_cleanup_hook_sweeps_only_its_flow_runs_sandboxes(credentials, ps_client) -> None:
    mine = ps_client.sandboxes.create(metadata=flow_run_key("etl", "run-1").metadata(), ttl_seconds=60)
    other = ps_client.sandboxes.create(metadata=flow_run_key("etl", "run-2").metadata(), ttl_seconds=60)

    class FakeFlow:  # the hook only reads .name and .id, as Prefect passes them
        name = "etl"

    class FakeRun:
        id = "run-1"

    sandbox_cleanup_hook(credentials)(FakeFlow(), FakeRun(), "Crashed")
    assert [sb.id for sb in ps_client.sandboxes.list()] == [other.id]
    assert mine.id != other.id
    ps_client.sandboxes.delete(other.id)
