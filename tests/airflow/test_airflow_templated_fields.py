"""Templated fields, as Airflow checks its own providers (and as users pass upstream values).

Airflow's rule for operators: ``__init__`` stores a templated field exactly as given
(a Jinja string, an ``XComArg``) and never transforms it; rendering happens later,
and validation after it. The first test is that check, over every operator class
of the provider; the DAG runs then pass plain values, whole-value Jinja templates
(rendered as native objects and as text) and ``XComArg`` values to all four
operators and ``@task.pandastack``.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pendulum
import pytest
from airflow.sdk import DAG, XComArg, task
from airflow.sdk.bases.decorator import DecoratedOperator
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider.decorators.pandastack import _PandaStackDecoratedOperator
from airflow_provider.operators.sandbox import PandaStackSandboxOperator
from airflow_provider.operators.warm_fork import (
    PandaStackForkOperator,
    PandaStackWarmPoolSetupOperator,
    PandaStackWarmPoolTeardownOperator,
)
from pandastack_jobs import option_names
from tests.support.dagtest import run_dag, task_instances, xcom

START = pendulum.datetime(2024, 1, 1, tz="UTC")
OPERATORS = [
    PandaStackSandboxOperator,
    PandaStackForkOperator,
    PandaStackWarmPoolSetupOperator,
    PandaStackWarmPoolTeardownOperator,
    _PandaStackDecoratedOperator,
]
REQUIRED = {"command": "true", "parent_id": "p-1", "python_callable": lambda: None}


def _init_params(cls: type) -> set[str]:
    """Every keyword ``cls.__init__`` takes along its MRO (what ``partial``/``expand`` accept too)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is not None:
            names |= {
                p.name
                for p in inspect.signature(init).parameters.values()
                if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD
            }
    return names - {"self"}


def _build(cls: type, dag: DAG, task_id: str, **values: Any) -> Any:
    kwargs = {k: v for k, v in REQUIRED.items() if k in _init_params(cls) and k not in values}
    if cls is _PandaStackDecoratedOperator:
        kwargs.pop("command", None)
    return cls(task_id=task_id, dag=dag, **kwargs, **values)


@pytest.mark.parametrize("cls", OPERATORS, ids=lambda c: c.__name__)
def test_init_stores_every_templated_field_as_given(cls: type) -> None:
    """Airflow's own provider check: a templated field is assigned untouched in ``__init__`` (a
    Jinja string stays that string, an XComArg stays that XComArg), and every one exists on the
    instance."""
    with DAG(f"tf_{cls.__name__}", schedule=None, start_date=START) as dag:

        @task
        def upstream() -> dict:
            return {}

        arg = upstream()
        assert isinstance(arg, XComArg)
        own = set(DecoratedOperator.template_fields)  # Airflow's op_args/op_kwargs: not ours to check
        fields = [f for f in cls.template_fields if f in _init_params(cls) and f not in own]
        assert fields, f"{cls.__name__} has no templated __init__ parameters"
        for i, name in enumerate(fields):
            for j, value in enumerate(("{{ params.v }}", arg)):
                op = _build(cls, dag, f"t{i}_{j}", **{name: value})
                assert getattr(op, name) is value, (
                    f"{cls.__name__}.__init__ transforms templated field {name!r}: "
                    f"{value!r} became {getattr(op, name)!r}"
                )
        op = _build(cls, dag, "plain")
        missing = [f for f in cls.template_fields if f not in vars(op)]
        assert not missing, f"templated fields not set on the instance: {missing}"


@pytest.mark.parametrize("cls", OPERATORS, ids=lambda c: c.__name__)
def test_every_conn_id_and_job_option_is_templated(cls: type) -> None:
    params = _init_params(cls)
    conn_ids = {p for p in params if p.endswith("conn_id")}
    assert "pandastack_conn_id" in conn_ids
    assert conn_ids <= set(cls.template_fields), conn_ids - set(cls.template_fields)
    if cls is not PandaStackWarmPoolTeardownOperator:
        options = set(option_names()) - ({"result_path"} if cls is _PandaStackDecoratedOperator else set())
        assert options <= params, options - params
        assert options <= set(cls.template_fields), options - set(cls.template_fields)


def test_a_plain_bad_value_fails_the_dag_import_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"permanent_exit_codes.*1 to 255"):
        PandaStackSandboxOperator(task_id="bad", command="true", permanent_exit_codes=[0])
    with pytest.raises(ValueError, match=r"collect: 'report.md' is a string, not a list"):
        PandaStackSandboxOperator(task_id="bad", command="true", collect="report.md")


@pytest.mark.parametrize(
    ("field", "rendered", "problem"),
    [
        ("env", "nope", "env: 'nope' is a string, not a mapping"),
        ("env", "{'A': [1]}", "env['A']"),
        ("collect", "{'a': 1}", "collect: \"{'a': 1}\" is a string, not a list"),
        ("collect", "[1, 2", "collect: '[1, 2' is neither JSON nor a Python literal"),
        ("timeout", "soon", "timeout: 'soon' is not a positive number"),
    ],
)
def test_a_bad_rendered_value_fails_the_task_naming_the_field(
    field: str, rendered: str, problem: str
) -> None:
    op = PandaStackSandboxOperator(task_id="t", command="true", **{field: "{{ params.v }}"})
    setattr(op, field, rendered)  # what rendering produced
    ti = SimpleNamespace(dag_id="d", task_id="t", run_id="r", map_index=-1, try_number=1)
    with pytest.raises(AirflowFailException) as info:
        op.build_spec({"ti": ti})  # type: ignore[arg-type]
    assert problem in str(info.value)


JOB = (
    'test "$GREETING" = hi && echo "$GREETING from $JOB_WORKDIR" > out.txt && '
    'printf \'{"greeting": "%s"}\' "$GREETING" > "$JOB_RESULT"'
)


def _dag(native: bool) -> DAG:
    """One DAG per rendering mode: each operator gets a plain value, a Jinja template and an
    XComArg for the fields that change shape (env, collect, metadata, conn ids, parent_id)."""
    params = {
        "env": {"GREETING": "hi"},
        "collect": ["out.txt"],
        "metadata": {"tenant": "acme"},
        "conn": "pandastack_default",
        "timeout": 60,
    }
    with DAG(
        f"ps_templated_{'native' if native else 'text'}",
        schedule=None,
        start_date=START,
        params=params,
        render_template_as_native_obj=native,
    ) as dag:

        @task(multiple_outputs=True)
        def upstream() -> dict:
            return {"env": {"GREETING": "hi"}, "collect": ["out.txt"], "metadata": {"team": "data"}}

        up = upstream()
        jinja = PandaStackSandboxOperator(
            task_id="jinja",
            command=JOB,
            env="{{ params.env }}",
            collect="{{ params.collect }}",
            metadata="{{ params.metadata }}",
            timeout="{{ params.timeout }}",
            pandastack_conn_id="{{ params.conn }}",
            object_storage_conn_id="{{ params.conn }}",
        )
        PandaStackSandboxOperator(
            task_id="xcomarg", command=JOB, env=up["env"], collect=up["collect"], metadata=up["metadata"]
        )
        plain = PandaStackSandboxOperator(
            task_id="plain", command=JOB, env={"GREETING": "hi"}, collect=["out.txt"], metadata={"k": "v"}
        )
        warm = PandaStackWarmPoolSetupOperator(
            task_id="warm",
            command=JOB,
            env="{{ params.env }}",
            collect=up["collect"],
            pandastack_conn_id="{{ params.conn }}",
        )
        fork = PandaStackForkOperator(
            task_id="fork",
            parent_id=warm.output,
            command=JOB,
            env=up["env"],
            collect="{{ params.collect }}",
            pandastack_conn_id="{{ params.conn }}",
        )
        cool = PandaStackWarmPoolTeardownOperator(
            task_id="cool", parent_id=warm.output, pandastack_conn_id="{{ params.conn }}"
        )

        @task.pandastack(
            env="{{ params.env }}", metadata=up["metadata"], pandastack_conn_id="{{ params.conn }}"
        )
        def greet() -> str:
            import os

            return os.environ["GREETING"]

        up >> [jinja, plain]  # plain values do not depend on upstream; keep the run ordered anyway
        warm >> fork >> cool.as_teardown(setups=warm)
        greet()
    return dag


@pytest.mark.parametrize("native", [True, False], ids=["native", "text"])
def test_plain_jinja_and_xcomarg_values_reach_the_job(airflow_env, local_server, native: bool) -> None:
    dr = run_dag(_dag(native))
    tis = task_instances(dr)
    assert {k[0]: ti.state for k, ti in tis.items()} == dict.fromkeys(
        ["upstream", "jinja", "xcomarg", "plain", "warm", "fork", "cool", "greet"], "success"
    )
    for task_id in ("jinja", "xcomarg", "plain", "fork"):
        assert xcom(dr, task_id) == {"greeting": "hi"}, task_id
        assert xcom(dr, task_id, "files")["/work/out.txt"]["text"] == "hi from /work\n", task_id
    assert xcom(dr, "warm", "warmup") == {"greeting": "hi"}
    assert xcom(dr, "greet") == "hi"
    assert local_server.client().sandboxes.list() == []


def test_trigger_gets_its_client_through_the_hook(airflow_env, local_server) -> None:
    """Issue 14 item 5: the trigger built its own client from the connection, bypassing the hook's
    key masking and redaction; now the hook hands it out (read without blocking the loop)."""
    import asyncio

    from airflow_provider.triggers.sandbox import PandaStackJobTrigger

    job = {"sandbox_id": "sb-x", "started_at": 0.0, "timeout": 1.0}
    trigger = PandaStackJobTrigger(job=job, pandastack_conn_id="pandastack_default")
    client = asyncio.run(trigger._client())
    assert client.api_url.rstrip("/") == local_server.url.rstrip("/")
    assert trigger.hook.connection is not None  # read by the hook, cached for get_conn
    leaked = f"poll failed for key {local_server.api_key}"
    assert local_server.api_key not in trigger.hook.redactor(leaked)
