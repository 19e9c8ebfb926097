"""What every PandaStack job operator shares: the job's fields, its options, its connection.

The job's options (``template``, ``timeout``, ``collect``, ``env``, ...) are the
core's declaration (:func:`pandastack_jobs.job_options`): this base class adds
one keyword parameter per option to ``__init__``'s signature (so Airflow's
``default_args`` and ``partial``/``expand`` see them) and templates them all.

As Airflow requires of templated fields, ``__init__`` stores every value exactly
as given (a plain value, a Jinja string, an ``XComArg``) and only reads them;
they are normalised and validated in ``execute``, after rendering, where an
error names the field. Values that will not be rendered are checked at once,
so a plain bad value still fails the DAG import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

import jinja2
from airflow.sdk import BaseOperator, XComArg

from pandastack_jobs import (
    NOT_GIVEN,
    JobSpec,
    JobSpecError,
    coerce_options,
    job_options,
    option_names,
    option_parameters,
    validate_options,
    with_parameters,
)
from pandastack_jobs.spec import FileContent

from ..attempt import job_key
from ..compat import HAS_RETRY_POLICY, AirflowFailException
from ..hooks.pandastack import PandaStackHook
from ..retries import pandastack_retry_policy
from ..templating import template_error_message

if TYPE_CHECKING:
    from airflow.sdk import Context

F = TypeVar("F")


def with_job_options(init: F) -> F:
    """Add a keyword parameter per job option (declared default) to ``init``'s signature.

    At run time, not for static tools: Airflow fills an operator's parameters from
    ``default_args`` (and checks ``partial``/``expand``) by reading ``__init__``'s signature, so
    every option must be a parameter there; BaseOperator's own ``**kwargs`` leave no room for an
    ``Unpack[JobOptions]`` that mypy could check."""
    init.__signature__ = with_parameters(init, option_parameters())  # type: ignore[attr-defined, arg-type]
    return init


def rendered_later(value: Any) -> bool:
    """True for a value Airflow renders or resolves before ``execute`` (Jinja, an XComArg)."""
    if isinstance(value, XComArg):
        return True
    if isinstance(value, str):
        return "{{" in value or "{%" in value
    if isinstance(value, Mapping):
        return any(rendered_later(k) or rendered_later(v) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(rendered_later(v) for v in value)
    return False


class PandaStackJobBaseOperator(BaseOperator):
    """A job in a PandaStack sandbox: ``command``, ``files``, ``input`` and the job's options.

    :param command: shell command run in ``/work`` inside the sandbox (templated).
    :param files: ``{path: content}`` written into the sandbox before the command;
        relative paths land under ``/work``. Content is ``str``, ``bytes`` or a
        ``pathlib.Path`` to a local file. Not templated: code often contains ``{{``.
    :param input: JSON value written to ``/work/input.json`` (``$JOB_INPUT``) (templated).
    :param pandastack_conn_id: the ``pandastack`` connection (templated).

    Every job option (docs/airflow.md lists them; :class:`pandastack_jobs.JobOptions` types them)
    is a keyword parameter, templated; ``None`` means what the core says (``ttl=None``: the timeout
    plus 60 s), :data:`~pandastack_jobs.NOT_GIVEN` the declared default.
    """

    template_fields: Sequence[str] = ("command", "input", *option_names(), "pandastack_conn_id")
    template_fields_renderers = {"input": "json", "metadata": "json", "env": "json", "command": "bash"}

    @with_job_options
    def __init__(
        self,
        *,
        command: str,
        files: Mapping[str, FileContent] | None = None,
        input: Any = None,
        pandastack_conn_id: str = PandaStackHook.default_conn_name,
        **kwargs: Any,
    ) -> None:
        given = {o.name: kwargs.pop(o.name, NOT_GIVEN) for o in job_options()}
        options = {o.name: o.default if given[o.name] is NOT_GIVEN else given[o.name] for o in job_options()}
        if HAS_RETRY_POLICY:  # Airflow >= 3.3; before, the exception class alone decides
            kwargs.setdefault("retry_policy", pandastack_retry_policy)
        super().__init__(**kwargs)
        self.command = command
        self.files = files
        self.input = input
        for name, value in options.items():
            setattr(self, name, value)
        self.pandastack_conn_id = pandastack_conn_id
        if not rendered_later(options):
            try:  # every value is final: a bad one fails the DAG import, not a run
                validate_options(options)
            except JobSpecError as exc:
                raise ValueError(f"{type(self).__name__} {self.task_id!r}: {exc}") from None

    def _do_render_template_fields(self, *args: Any, **kwargs: Any) -> None:
        """Render as Airflow does; a template error dead-letters the try (no retry can fix it).
        Overridden here, not in ``render_template_fields``: a mapped task renders through this."""
        try:
            super()._do_render_template_fields(*args, **kwargs)
        except jinja2.TemplateError as exc:
            raise AirflowFailException(template_error_message(self.task_id, exc)) from None

    @cached_property
    def hook(self) -> PandaStackHook:
        return PandaStackHook(pandastack_conn_id=self.pandastack_conn_id)

    def job_fields(self, context: Context) -> dict[str, Any]:
        """``command``, ``files``, ``input`` and ``result_path`` of the job (the decorator overrides)."""
        return {
            "command": self.command,
            "files": dict(self.files or {}),
            "input": self.input,
            "result_path": self.result_path,  # type: ignore[attr-defined]
        }

    def build_spec(self, context: Context, **extra: Any) -> JobSpec:
        """The core job spec for this try, from the rendered fields. A bad spec fails the task at
        once (no retry can fix it), naming the field."""
        try:
            options = coerce_options({name: getattr(self, name) for name in option_names()})
            return JobSpec(**{**options, **self.job_fields(context), **extra}, key=job_key(context))
        except JobSpecError as exc:
            raise AirflowFailException(f"PandaStack job {self.task_id!r} is invalid: {exc}") from None
