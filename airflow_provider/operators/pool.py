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

from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

import pandastack
from airflow.sdk import BaseOperator

from pandastack_jobs import (
    RESULT_PATH,
    JobHandle,
    JobOutcome,
    JobSpec,
    JobSpecError,
    WarmPool,
    WarmupFailed,
)
from pandastack_jobs.forkpool import DEFAULT_PARENT_TTL
from pandastack_jobs.spec import DEFAULT_TEMPLATE, DEFAULT_TIMEOUT, FileContent

from ..exceptions import exception_for
from ..hooks.pandastack import PandaStackHook
from ..retry import pandastack_retry_policy
from .sandbox import STATE_KEY, PandaStackSandboxOperator, job_key, reap_recorded

if TYPE_CHECKING:
    from airflow.sdk import Context


class PandaStackWarmPoolSetupOperator(BaseOperator):
    """Create a parent sandbox, run the warm-up in it once, and return its id.

    :param command: the warm-up command (templated).
    :param files: files for the warm-up (not templated).
    :param input: JSON input for the warm-up (templated).
    :param template: sandbox template of the parent (and so of every fork).
    :param timeout: the warm-up's hard clock, seconds.
    :param parent_ttl: the parent's idle backstop, seconds (it must outlive the jobs).
    :param result_path: where the warm-up may write a JSON result (pushed as XCom ``warmup``).
    """

    template_fields: Sequence[str] = ("command", "input", "template", "env")
    ui_color = "#fbd38d"

    def __init__(
        self,
        *,
        command: str,
        files: Mapping[str, FileContent] | None = None,
        input: Any = None,
        template: str = DEFAULT_TEMPLATE,
        timeout: float = DEFAULT_TIMEOUT,
        parent_ttl: int = DEFAULT_PARENT_TTL,
        result_path: str | None = RESULT_PATH,
        env: Mapping[str, str] | None = None,
        pandastack_conn_id: str = PandaStackHook.default_conn_name,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("retry_policy", pandastack_retry_policy)
        super().__init__(**kwargs)
        self.command = command
        self.files = dict(files or {})
        self.input = input
        self.template = template
        self.timeout = timeout
        self.parent_ttl = parent_ttl
        self.result_path = result_path
        self.env = dict(env or {})
        self.pandastack_conn_id = pandastack_conn_id

    @cached_property
    def hook(self) -> PandaStackHook:
        return PandaStackHook(pandastack_conn_id=self.pandastack_conn_id)

    def execute(self, context: Context) -> str:
        try:
            spec = JobSpec(
                command=self.command,
                files=self.files,
                input=self.input,
                template=self.template,
                timeout=self.timeout,
                result_path=self.result_path,
                env={str(k): str(v) for k, v in self.env.items()},
                key=job_key(context),
            )
        except JobSpecError as exc:
            from airflow.sdk.exceptions import AirflowFailException

            raise AirflowFailException(f"PandaStack warm-up is invalid: {exc}") from None
        client = self.hook.get_conn()
        reap_recorded(self.log, context, client)
        pool = WarmPool(client, warmup=spec, parent_ttl=self.parent_ttl, redactor=self.hook.redactor)
        try:
            parent_id = pool.start_parent()
        except WarmupFailed as exc:
            error = exception_for(exc.outcome)
            self.log.error("PandaStack warm-up failed: %s", error)
            raise error from None
        store = context.get("task_state_store")
        if store is not None:
            store.set(STATE_KEY, parent_id)
        outcome = pool.warmup_outcome
        context["ti"].xcom_push(key="sandbox_id", value=parent_id)
        if outcome is not None:
            context["ti"].xcom_push(key="pandastack", value=outcome.summary())
            if outcome.has_result:
                context["ti"].xcom_push(key="warmup", value=outcome.result)
            for line in outcome.stdout_tail.splitlines():
                self.log.info("[warm-up stdout] %s", line)
        self.log.info("PandaStack: warm parent %s ready", parent_id)
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
            from airflow.sdk.exceptions import AirflowFailException

            raise AirflowFailException("PandaStackForkOperator: parent_id is empty (did the setup task run?)")
        pool = WarmPool.attach(client, str(self.parent_id), redactor=self.hook.redactor)
        return pool.run(spec, on_created=on_created, on_output=on_output, handle=handle)


class PandaStackWarmPoolTeardownOperator(BaseOperator):
    """Delete the warm parent and any fork left behind. Use with ``.as_teardown(setups=...)``.

    :param parent_id: the parent's id, usually ``setup_task.output`` (templated).
        Empty (the setup failed before creating one): nothing to do.
    """

    template_fields: Sequence[str] = ("parent_id",)
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
            self.log.info("PandaStack: no warm parent to delete")
            return
        hook = PandaStackHook(pandastack_conn_id=self.pandastack_conn_id)
        WarmPool.attach(hook.get_conn(), str(self.parent_id), redactor=hook.redactor).close()
        self.log.info("PandaStack: warm parent %s and its leftover forks deleted", self.parent_id)
