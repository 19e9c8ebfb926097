"""Issue 38: inside Prefect the job's span is a child of Prefect's own task-run span (Prefect's
engine emits one per task run to the configured tracer provider), with the lifecycle's steps under
it; the SDK's in-memory exporter reads the tree back."""

from __future__ import annotations

from prefect import flow

from prefect_blocks import run_in_sandbox
from tests.support.otel import STEPS, all_text, children, exporter, named


def test_the_job_span_is_a_child_of_prefects_task_run_span(credentials, local_server) -> None:
    spans_out = exporter()

    @flow
    def traced() -> object:
        return run_in_sandbox(
            command='echo \'{"n": 7}\' > "$JOB_RESULT"', credentials=credentials, timeout=60, template="base"
        )

    state = traced(return_state=True)
    assert state.is_completed(), state.message
    spans = spans_out.get_finished_spans()
    [job] = named(spans, "pandastack.job")
    parent = next(s for s in spans if s.context.span_id == job.parent.span_id)
    assert parent.attributes["prefect.run.type"] == "task"
    flow_span = next(s for s in spans if s.context.span_id == parent.parent.span_id)
    assert flow_span.attributes["prefect.run.type"] == "flow"
    assert [s.name for s in children(spans, job)] == STEPS
    assert job.attributes["pandastack.outcome.class"] == "ok"
    assert job.attributes["pandastack.sandbox.id"]
    assert local_server.api_key not in all_text(spans)
