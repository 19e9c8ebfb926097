"""Issue 38: an Airflow task's job is one ``pandastack.job`` span with the lifecycle's steps under
it, a child of the span current in the task (Airflow's task runner starts ``worker.<task_id>`` in
the supervised task process; ``dag.test()`` runs tasks in-process without it, so the test runs the
DAG inside a span of its own and checks the job span nests under the current context)."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG
from opentelemetry import trace

from airflow_provider.operators.sandbox import PandaStackSandboxOperator
from tests.support.dagtest import run_dag, task_instances
from tests.support.otel import STEPS, all_text, children, exporter, named

START = pendulum.datetime(2024, 1, 1, tz="UTC")


def test_an_airflow_task_job_is_a_span_tree_under_the_current_span(airflow_env, local_server) -> None:
    spans_out = exporter()
    with DAG("ps_traced", schedule=None, start_date=START) as dag:
        PandaStackSandboxOperator(
            task_id="traced", command='echo \'{"n": 1}\' > "$JOB_RESULT"', timeout=60, template="base"
        )
    with trace.get_tracer("test").start_as_current_span("worker.traced") as task_span:
        dr = run_dag(dag)
    assert task_instances(dr)[("traced", -1)].state == "success"
    spans = spans_out.get_finished_spans()
    [job] = named(spans, "pandastack.job")
    assert job.parent is not None and job.context.trace_id == task_span.get_span_context().trace_id
    assert [s.name for s in children(spans, job)] == STEPS
    assert job.attributes["pandastack.outcome.class"] == "ok"
    assert job.attributes["pandastack.engine"] == "airflow"
    assert local_server.api_key not in all_text(spans)
