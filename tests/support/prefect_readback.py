"""Reading back what a flow run left in the Prefect API (artifacts, logs, task runs)."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.logging.handlers import APILogWorker


def flow_run_id(state: Any) -> UUID:
    return state.state_details.flow_run_id


def artifacts(run_id: UUID) -> list[Any]:
    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
        )


def logs(run_id: UUID) -> str:
    APILogWorker.drain_all(timeout=10)
    with get_client(sync_client=True) as client:
        records = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
    return "\n".join(r.message for r in records)


def task_runs(run_id: UUID) -> list[Any]:
    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))


def artifacts_text(run_id: UUID) -> str:
    """Every artifact of the run (key, data, description) as one text, for leak checks."""
    return "\n".join(f"{a.key} {a.data} {a.description}" for a in artifacts(run_id))
