"""An explicit ``retry_delay_seconds`` is Prefect's delay; left alone, the package's jittered one.

Measured on real flows: the gap between the end of the first attempt and the start of the
second, from the attempts' own log records in the Prefect API.
"""

from __future__ import annotations

from datetime import timedelta
from uuid import UUID

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.logging.handlers import APILogWorker

from prefect_blocks import run_in_sandbox
from tests.support.prefect_readback import flow_run_id, task_runs

BASE = 6.0  # our delay for the first retry is then in [3, 6] s
FAILS = "echo failing >&2; exit 3"


def retry_gap(run_id: UUID) -> timedelta:
    """From 'job failed, redeliverable' (attempt 1) to 'job running in sandbox' of attempt 2."""
    APILogWorker.drain_all(timeout=10)
    with get_client(sync_client=True) as client:
        records = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
    failed = [r.timestamp for r in records if "job failed, redeliverable" in r.message]
    started = [r.timestamp for r in records if "job running in sandbox" in r.message]
    assert len(failed) == 2 and len(started) == 2, [r.message for r in records]
    return min(started[1:]) - min(failed)


@pytest.fixture
def slow_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_INTEGRATIONS_PANDASTACK_RETRY_BASE_SECONDS", str(BASE))


def test_explicit_zero_retry_delay_retries_at_once(credentials, slow_backoff) -> None:
    @flow
    def no_delay() -> object:
        return run_in_sandbox.with_options(retries=1, retry_delay_seconds=0)(
            command=FAILS, credentials=credentials, timeout=30
        )

    state = no_delay(return_state=True)
    assert state.is_failed()
    assert [r.run_count for r in task_runs(flow_run_id(state))] == [2]
    gap = retry_gap(flow_run_id(state)).total_seconds()
    # Without our delay only Prefect's state round trips and one sandbox listing remain.
    assert 0 <= gap < BASE / 2 - 0.5, gap


def test_default_retry_delay_is_the_jittered_redelivery_delay(credentials, slow_backoff) -> None:
    @flow
    def default_delay() -> object:
        return run_in_sandbox.with_options(retries=1)(command=FAILS, credentials=credentials, timeout=30)

    state = default_delay(return_state=True)
    assert state.is_failed()
    gap = retry_gap(flow_run_id(state)).total_seconds()
    assert BASE / 2 <= gap < BASE + 10, gap
