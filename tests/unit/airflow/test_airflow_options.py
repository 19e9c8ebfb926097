"""The Airflow operators take a job's options and the queue consumer's settings from the core's
declarations; ``None`` is the core's None, ``NOT_GIVEN`` the declared default."""

from __future__ import annotations

import inspect
from dataclasses import fields
from typing import Any

from pandastack_jobs import NOT_GIVEN, job_options, option_names
from pandastack_jobs.queue import CONSUMER_DEFAULTS, ConsumerSettings
from tests.unit.airflow.tis import context


def test_every_option_is_an_init_parameter_with_its_declared_default() -> None:
    # Through the sandbox module: the base operator's own module is being renamed (t26-names).
    from airflow_provider.operators.sandbox import PandaStackJobBaseOperator, PandaStackSandboxOperator

    params = inspect.signature(PandaStackJobBaseOperator.__init__).parameters
    for o in job_options():
        assert params[o.name].default == o.default and params[o.name].annotation == o.annotation, o.name
    assert set(option_names()) <= set(PandaStackSandboxOperator.template_fields)


def test_ttl_none_is_the_cores_none_and_not_given_the_default() -> None:
    from airflow_provider.operators.sandbox import PandaStackSandboxOperator

    def spec(**options: Any) -> Any:
        op = PandaStackSandboxOperator(task_id="t", command="x", timeout=50, **options)
        return op.build_spec(context())

    assert spec(ttl=None).ttl_seconds == 110
    assert spec(ttl=NOT_GIVEN, template=NOT_GIVEN).template == "code-interpreter"
    assert spec(ttl=900).ttl_seconds == 900


def test_the_queue_operator_takes_the_consumers_defaults() -> None:
    from airflow_provider.operators.queue import PandaStackQueueOperator

    params = inspect.signature(PandaStackQueueOperator.__init__).parameters
    shared = [f.name for f in fields(ConsumerSettings) if f.name in params and f.name != "drain_seconds"]
    assert len(shared) >= 6
    for name in shared:
        assert params[name].default == getattr(CONSUMER_DEFAULTS, name), name
    assert params["drain_seconds"].default == CONSUMER_DEFAULTS.batch_drain_seconds
