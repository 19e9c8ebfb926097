"""Warm-fork pools: pay an expensive warm-up once, run each mapped job in its own fork.

With Airflow setup/teardown semantics::

    warm = PandaStackWarmPoolSetupOperator(task_id="warm", command="python3 warmup.py", files=...)
    score = PandaStackForkOperator.partial(
        task_id="score", parent_id=warm.output, command="python3 score.py", files=...
    ).expand(input=items)
    done = PandaStackWarmPoolTeardownOperator(task_id="cool", parent_id=warm.output)
    warm >> score >> done.as_teardown(setups=warm)

The setup task creates a parent sandbox, runs the warm-up in it once and
pushes the parent's id (``return_value``). Each fork task runs its job in a
fresh fork of that parent (own TTL, deleted afterwards, same XComs and
retries as :class:`PandaStackSandboxOperator`). The teardown deletes the parent
and any fork a crashed job left, and runs even when jobs fail. The pool logic
is the core's :class:`pandastack_jobs.WarmPool`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pandastack
from airflow.sdk import BaseOperator

from pandastack_jobs import DEFAULT_PARENT_TTL, JobHandle, JobOutcome, JobSpec, WarmPool, WarmupFailed

from ..attempt import reap_recorded, record_sandbox
from ..compat import AirflowFailException
from ..exceptions import exception_for
from ..hooks.pandastack import PandaStackHook
from .base import PandaStackJobBaseOperator
from .sandbox import PandaStackSandboxOperator

if TYPE_CHECKING:
    from airflow.sdk import Context


class PandaStackWarmPoolSetupOperator(PandaStackJobBaseOperator):
    """Create a parent sandbox, run the warm-up in it once, and return its id.

    :param command: the warm-up command (templated).
    :param files: files for the warm-up (not templated).
    :param input: JSON input for the warm-up (templated).
    :param parent_ttl: the parent's idle backstop, seconds (it must outlive the jobs).
    :param pandastack_conn_id: the ``pandastack`` connection (templated).

    The job's options apply to the warm-up, as for :class:`PandaStackSandboxOperator`
    (``template`` is the parent's and so every fork's; a JSON result the warm-up
    writes is pushed as XCom ``warmup``).
    """

    ui_color = "#fbd38d"

    def __init__(self, *, parent_ttl: int = DEFAULT_PARENT_TTL, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.parent_ttl = parent_ttl

    def execute(self, context: Context) -> str:
        spec = self.build_spec(context)
        client = self.hook.get_conn()
        reap_recorded(self.log, context, client)
        pool = WarmPool(client, warmup=spec, parent_ttl=self.parent_ttl, redactor=self.hook.redactor)
        try:
            parent_id = pool.start_parent()
        except WarmupFailed as exc:
            error = exception_for(exc.outcome)
            self.log.error("warm-up failed: %s", error)
            raise error from None
        record_sandbox(self.log, context, parent_id)
        outcome = pool.warmup_outcome
        context["ti"].xcom_push(key="sandbox_id", value=parent_id)
        if outcome is not None:
            context["ti"].xcom_push(key="pandastack", value=outcome.summary())
            if outcome.has_result:
                context["ti"].xcom_push(key="warmup", value=outcome.result)
            for line in outcome.stdout_tail.splitlines():
                self.log.info("[warm-up stdout] %s", line)
        self.log.info("warm parent %s ready", parent_id)
        return parent_id


class PandaStackForkOperator(PandaStackSandboxOperator):
    """:class:`PandaStackSandboxOperator` whose sandbox is a fresh fork of a warm parent.

    :param parent_id: the parent's id, usually ``setup_task.output`` (templated).
    Not deferrable.
    """

    template_fields: Sequence[str] = (*PandaStackSandboxOperator.template_fields, "parent_id")

    def __init__(self, *, parent_id: str, **kwargs: Any) -> None:
        if kwargs.get("deferrable"):
            raise ValueError("PandaStackForkOperator cannot be deferrable: forks run in the foreground")
        super().__init__(**kwargs)
        self.parent_id = parent_id

    def run_spec(
        self,
        context: Context,
        client: pandastack.Client,
        spec: JobSpec,
        *,
        on_created: Callable[[str], None],
        on_output: Callable[[str, str], None] | None,
        handle: JobHandle,
    ) -> JobOutcome:
        if not self.parent_id:
            raise AirflowFailException("PandaStackForkOperator: parent_id is empty (did the setup task run?)")
        pool = WarmPool.attach(client, str(self.parent_id), redactor=self.hook.redactor)
        return pool.run(spec, on_created=on_created, on_output=on_output, handle=handle)


class PandaStackWarmPoolTeardownOperator(BaseOperator):
    """Delete the warm parent and any fork left behind. Use with ``.as_teardown(setups=...)``.

    :param parent_id: the parent's id, usually ``setup_task.output`` (templated).
        Empty (the setup failed before creating one): nothing to do.
    """

    template_fields: Sequence[str] = ("parent_id", "pandastack_conn_id")
    ui_color = "#fbd38d"

    def __init__(
        self,
        *,
        parent_id: str | None,
        pandastack_conn_id: str = PandaStackHook.default_conn_name,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.parent_id = parent_id
        self.pandastack_conn_id = pandastack_conn_id

    def execute(self, context: Context) -> None:
        if not self.parent_id:
            self.log.info("no warm parent to delete")
            return
        hook = PandaStackHook(pandastack_conn_id=self.pandastack_conn_id)
        WarmPool.attach(hook.get_conn(), str(self.parent_id), redactor=hook.redactor).close()
        self.log.info("warm parent %s and its leftover forks deleted", self.parent_id)
