"""A job's options, declared once: the :func:`~pandastack_jobs.spec.option` fields of :class:`JobSpec`.

Name, type, default, validation and docs line of every option live on
``JobSpec``; this module reads them back so that each adapter (the Airflow
operators and ``@task.pandastack``, the Prefect block, ``run_in_sandbox`` and
``@sandbox_task``, the fork pools) derives its parameters from that one
declaration instead of repeating it. Adding an option means adding a field
there and its line in :class:`JobOptions` (a unit test fails until both agree); the adapters
pick it up.

"Not given" is :data:`NOT_GIVEN`, never ``None``: ``None`` is a value where the declaration admits
it (``ttl=None``: the timeout plus the margin; ``result_path=None``: the job has no result).
"""

from __future__ import annotations

import ast
import inspect
import json
import types
import typing
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from functools import cache
from typing import Any, Final, TypedDict, Union

from .exceptions import JobSpecError
from .spec import JobSpec


class NotGiven:
    """The type of :data:`NOT_GIVEN`: an option the caller did not give (distinct from ``None``)."""

    _instance: NotGiven | None = None

    def __new__(cls) -> NotGiven:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NOT_GIVEN"

    def __bool__(self) -> bool:
        return False

    def __reduce__(self) -> str:
        return "NOT_GIVEN"  # pickled (e.g. in an engine's task parameters) as the one instance

    def __copy__(self) -> NotGiven:
        return self

    def __deepcopy__(self, memo: Any) -> NotGiven:
        return self


NOT_GIVEN: Final = NotGiven()
"""An option left out: the adapter's value (a block's field, the declared default) applies."""


class JobOptions(TypedDict, total=False):
    """The job's options as keyword arguments, for static tools: ``**options: Unpack[JobOptions]``.

    The same names and types as the :func:`~pandastack_jobs.spec.option` fields of
    :class:`JobSpec` (``tests/unit/core/test_options_declared_once.py`` fails when they differ);
    the docs of each are there. An adapter also accepts the text forms :meth:`JobOption.coerce`
    reads (a rendered template, a form field).
    """

    result_path: str | None
    collect: Sequence[str]
    template: str
    timeout: float
    ttl: int | None
    metadata: Mapping[str, str]
    env: Mapping[str, str]
    permanent_exit_codes: Collection[int]
    retry_on_timeout: bool
    max_result_bytes: int
    max_file_bytes: int


def admits_none(annotation: Any) -> bool:
    """Whether ``None`` is a value of ``annotation`` (``int | None`` yes, ``float`` no)."""
    return annotation is None or annotation is type(None) or type(None) in typing.get_args(annotation)


@dataclass(frozen=True)
class JobOption:
    """One option of a job: what every adapter needs to offer it."""

    name: str
    annotation: Any
    """The Python type a user passes (as declared on :class:`JobSpec`)."""
    doc: str
    _default: Any
    _factory: Callable[[], Any] | None

    @property
    def default(self) -> Any:
        """The default value (a fresh one for mutable defaults)."""
        return self._factory() if self._factory is not None else self._default

    @property
    def admits_none(self) -> bool:
        """Whether ``None`` is a value of this option (then it means what :class:`JobSpec` says)."""
        return admits_none(self.annotation)

    @property
    def shape(self) -> str:
        """``"mapping"``, ``"sequence"`` or ``"scalar"``: how a value given as text is read."""
        origin = typing.get_origin(self.annotation)
        if origin in (Mapping, dict):
            return "mapping"
        if origin in (Sequence, Collection, list, tuple):
            return "sequence"
        return "scalar"

    @property
    def type_name(self) -> str:
        """The type as the docs show it, e.g. ``float`` or ``int | None``."""
        return _type_name(self.annotation)

    def coerce(self, value: Any) -> Any:
        """Normalise a value that came through an orchestrator (a rendered template, an upstream
        result, a form) to what :class:`JobSpec` takes; raise :class:`JobSpecError` naming the option.

        A list or mapping that arrived as text (Jinja renders to text unless told otherwise) is
        read as JSON, else as a Python literal (``ast.literal_eval``: literals only, never code).
        Mapping values that are numbers or booleans become strings, as environment variables are.
        """
        shape = self.shape
        if value is None:
            return value
        if shape == "scalar":
            return self._scalar(value)
        if isinstance(value, str):
            value = _parse_text(self.name, value, shape)
        if shape == "mapping":
            if not isinstance(value, Mapping):
                raise JobSpecError(
                    self.name, f"{_short(value)} is not a mapping", 'give {"NAME": "value", ...}'
                )
            return {_scalar_text(self.name, k): _scalar_text(self.name, v, key=k) for k, v in value.items()}
        if isinstance(value, (Mapping, bytes)) or not isinstance(value, Iterable):
            raise JobSpecError(self.name, f"{_short(value)} is not a list", "give a list, e.g. ['report.md']")
        return list(value)

    def _scalar(self, value: Any) -> Any:
        """A number or bool that arrived as text (``"30"``, ``"false"``) is read as JSON."""
        accepted = typing.get_args(self.annotation) or (self.annotation,)
        if not isinstance(value, str) or str in accepted:
            return value
        try:
            parsed = json.loads(
                value.strip().lower() if value.strip().lower() in ("true", "false") else value
            )
        except ValueError:
            return value  # JobSpec rejects it, naming the option
        return parsed if isinstance(parsed, (int, float, bool)) or parsed is None else value


def _parse_text(name: str, text: str, shape: str) -> Any:
    stripped = text.strip()
    kind, opener, example = (
        ("mapping", "{", '{"NAME": "value"}') if shape == "mapping" else ("list", "[(", "['report.md']")
    )
    if not stripped and shape == "sequence":
        return []
    if not stripped or stripped[0] not in opener:
        raise JobSpecError(
            name, f"{_short(text)} is a string, not a {kind}", f"give a {kind}, e.g. {example}"
        )
    try:
        return json.loads(stripped)
    except ValueError:
        pass
    try:
        return ast.literal_eval(stripped)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise JobSpecError(
            name, f"{_short(text)} is neither JSON nor a Python literal", f"give a {kind}, e.g. {example}"
        ) from None


def _scalar_text(name: str, value: Any, key: Any = None) -> Any:
    if isinstance(value, (bool, int, float)) and key is not None:
        return str(value)
    return value  # JobSpec rejects anything else, naming the entry


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(annotation, "__name__", str(annotation))


@cache
def job_options() -> tuple[JobOption, ...]:
    """Every option of a job, in declaration order."""
    hints = typing.get_type_hints(JobSpec)
    found = []
    for f in fields(JobSpec):
        if "doc" not in f.metadata:
            continue
        factory = None if f.default_factory is MISSING else f.default_factory
        found.append(JobOption(f.name, hints[f.name], f.metadata["doc"], f.default, factory))
    return tuple(found)


def option_names() -> tuple[str, ...]:
    """The names of :func:`job_options`."""
    return tuple(o.name for o in job_options())


def job_option(name: str) -> JobOption:
    """The option called ``name`` (KeyError if there is none)."""
    for o in job_options():
        if o.name == name:
            return o
    raise KeyError(name)


def given_options(values: Mapping[str, Any]) -> dict[str, Any]:
    """The options of ``values`` a caller gave: :data:`NOT_GIVEN` is dropped, and so is ``None``
    for an option whose type does not admit it (``timeout=None``: a call written when None meant
    "not given" keeps working). ``None`` stays where it is a value (``ttl``, ``result_path``).
    Names that are not options are kept, for :func:`coerce_options` to name."""
    names = set(option_names())
    return {
        k: v
        for k, v in values.items()
        if v is not NOT_GIVEN and not (v is None and k in names and not job_option(k).admits_none)
    }


def merge_options(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` (a block's fields, a queue's defaults) under the :func:`given_options` of
    ``overrides`` (a call's): what an adapter passes to :func:`coerce_options`, once."""
    return {**given_options(base), **given_options(overrides)}


def coerce_options(values: Mapping[str, Any]) -> dict[str, Any]:
    """:meth:`JobOption.coerce` on each of ``values`` (unknown names are an error naming them;
    :data:`NOT_GIVEN` values are left out)."""
    values = {k: v for k, v in values.items() if v is not NOT_GIVEN}
    unknown = sorted(set(values) - set(option_names()))
    if unknown:
        raise JobSpecError(
            ", ".join(unknown), "is not a job option", f"use one of {', '.join(option_names())}"
        )
    return {name: job_option(name).coerce(value) for name, value in values.items()}


def validate_options(values: Mapping[str, Any]) -> None:
    """Check option values now, as a job would (an adapter calls this at definition time for the
    values that are not rendered later). Raises :class:`JobSpecError` naming the option."""
    JobSpec(command=":", **coerce_options(values))


def option_parameters(
    names: Iterable[str] | None = None, *, optional: bool = False
) -> list[inspect.Parameter]:
    """Keyword-only parameters for an adapter's signature, one per option.

    For an engine that reads a runtime signature (Airflow's ``default_args``). ``optional=True``
    makes every default ``None``, as the Prefect tasks had it before :data:`NOT_GIVEN`; new code
    types its keywords ``**options: Unpack[JobOptions]`` instead. Otherwise the declared defaults.
    """
    chosen = job_options() if names is None else tuple(job_option(n) for n in names)
    params = []
    for o in chosen:
        annotation = typing.Optional[o.annotation] if optional else o.annotation
        default = None if optional else o.default
        params.append(
            inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
        )
    return params


def with_parameters(
    fn: Callable[..., Any], params: Sequence[inspect.Parameter], *, keep_var_keyword: bool = True
) -> inspect.Signature:
    """``fn``'s signature with ``params`` inserted before its ``**kwargs``, which is kept or dropped
    (dropped: the options are all ``fn`` takes as keywords, as a public signature shows it)."""
    signature = inspect.signature(fn)
    before = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    after = [
        p
        for p in signature.parameters.values()
        if p.kind is inspect.Parameter.VAR_KEYWORD and keep_var_keyword
    ]
    taken = {p.name for p in before}
    return signature.replace(parameters=[*before, *(p for p in params if p.name not in taken), *after])


def options_table(names: Iterable[str] | None = None) -> str:
    """A Markdown table of the options (the docs' parameter tables are checked against it)."""
    chosen = job_options() if names is None else tuple(job_option(n) for n in names)
    rows = ["| Option | Type | Default | What it does |", "| --- | --- | --- | --- |"]
    for o in chosen:
        type_name = o.type_name.replace("|", "\\|")  # a pipe inside a table cell
        rows.append(f"| `{o.name}` | `{type_name}` | `{_default_text(o.default)}` | {o.doc} |")
    return "\n".join(rows)


def _default_text(value: Any) -> str:
    if isinstance(value, (tuple, list)) and not value:
        return "[]"
    return repr(value)
