"""``@task.pandastack``: run a Python function's source in a fresh sandbox.

The function's source (not a pickle) is shipped into the sandbox; its
arguments cross as JSON into ``/work/input.json`` and its return value comes
back as JSON from ``/work/result.json`` (:func:`pandastack_jobs.function_job`).
Nothing is pickled or ``eval``-ed in either direction. The function must be
self-contained: imports go inside it, and it cannot see the DAG file's globals.

    @task.pandastack(timeout=60, retries=2)
    def transform(rows: list[dict]) -> dict:
        import statistics
        return {"mean": statistics.mean(r["amount"] for r in rows)}

Everything else (retries as redelivery, reaping, XComs, ``on_kill``,
``deferrable``) is :class:`~airflow_provider.operators.sandbox.PandaStackSandboxOperator`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk.bases.decorator import DecoratedOperator, task_decorator_factory

from pandastack_jobs import JobSpecError, function_job
from pandastack_jobs.pyfunc import COMMAND

from ..compat import AirflowFailException
from ..operators.sandbox import PandaStackSandboxOperator

if TYPE_CHECKING:
    from airflow.sdk import Context
    from airflow.sdk.bases.decorator import TaskDecorator


class _PandaStackDecoratedOperator(DecoratedOperator, PandaStackSandboxOperator):
    custom_operator_name = "@task.pandastack"

    template_fields: Sequence[str] = (
        *DecoratedOperator.template_fields,
        *(
            f
            for f in PandaStackSandboxOperator.template_fields
            if f not in ("command", "input", "result_path")
        ),
    )
    template_fields_renderers = {
        **DecoratedOperator.template_fields_renderers,
        **PandaStackSandboxOperator.template_fields_renderers,
    }

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Collection[Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        for name in ("command", "input", "result_path"):
            if name in kwargs:
                raise TypeError(f"@task.pandastack does not take {name!r}: the function is the job")
        super().__init__(
            python_callable=python_callable,
            op_args=op_args,
            op_kwargs=op_kwargs,
            kwargs_to_upstream={"command": COMMAND},
            **kwargs,
        )

    def job_fields(self, context: Context) -> dict[str, Any]:
        try:
            job = function_job(self.python_callable, tuple(self.op_args), dict(self.op_kwargs))
        except JobSpecError as exc:
            raise AirflowFailException(f"@task.pandastack: {exc}") from None
        return {**job, "files": {**(self.files or {}), **job["files"]}}


def pandastack_task(
    python_callable: Callable[..., Any] | None = None,
    multiple_outputs: bool | None = None,
    **kwargs: Any,
) -> TaskDecorator:
    """The ``@task.pandastack`` decorator (registered by the provider as ``pandastack``)."""
    return task_decorator_factory(
        python_callable=python_callable,
        multiple_outputs=multiple_outputs,
        decorated_operator_class=_PandaStackDecoratedOperator,
        **kwargs,
    )
