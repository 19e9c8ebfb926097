"""What one job is: an immutable, validated description of a sandbox run.

Everything a job needs is checked here, before any sandbox exists, so bad input
fails fast with an error naming the field and the fix, and nothing is lost.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any, Union, cast

from .classify import Classifier
from .exceptions import JobSpecError

WORKDIR = "/work"
INPUT_PATH = "/work/input.json"
RESULT_PATH = "/work/result.json"
DEFAULT_TEMPLATE = "code-interpreter"
DEFAULT_TIMEOUT = 300.0
# TTL is an idle backstop on the server, reset by activity. It must outlast the
# job's own clock so that only a job whose orchestrator died is reaped by it.
TTL_MARGIN_SECONDS = 60
MAX_RESULT_BYTES = 16 * 1024 * 1024
MAX_FILE_BYTES = 32 * 1024 * 1024  # the server's upload limit, mirrored for downloads
DEFAULT_PARENT_TTL = 3600  # a warm pool's parent: it must outlive the jobs forked from it
TAIL_BYTES = 8 * 1024
TEMPLATE_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# Names that are another route of the templates API (``GET /v1/templates/<name>``): its answer for
# them is not a template's, so an unknown one could not be told from a server error.
ROUTE_NAMES = frozenset({".", "..", "builds"})
METADATA_VALUE_MAX = 256
MANAGED_BY = "pandastack-workflows"

FileContent = Union[bytes, str, Path]


def guest_path(path: str, field_name: str, workdir: str = WORKDIR) -> str:
    """Resolve a job path to an absolute guest path (relative ones live under ``workdir``).

    ``..`` is refused outright: a job path that climbs is a bug or an attack.
    """
    if not isinstance(path, str) or not path.strip():
        raise JobSpecError(field_name, f"path {path!r} is empty or not a string", "give a file path")
    if "\x00" in path:
        raise JobSpecError(field_name, f"path {path!r} contains a NUL byte", "remove it")
    pure = PurePosixPath(path)
    if ".." in pure.parts:
        raise JobSpecError(
            field_name,
            f"path {path!r} contains '..'",
            f"use a path inside the sandbox without '..', e.g. {workdir}/data.csv",
        )
    absolute = pure if pure.is_absolute() else PurePosixPath(workdir) / pure
    if str(absolute) == "/":
        raise JobSpecError(field_name, "path is the root directory", "name a file")
    return str(absolute)


class Engine:
    """The orchestrators' names, declared once: ``JobKey.engine``, written on every sandbox as
    ``job_engine`` (what the reapers and sweeps match). A ``JobKey`` may carry any other name."""

    AIRFLOW = "airflow"  # a task try of the operators and @task.pandastack
    AIRFLOW_EXECUTOR = "airflow-executor"  # a task try of PandaStackExecutor
    PREFECT = "prefect"  # a Prefect task run (run_in_sandbox, @sandbox_task, the fork pool)
    PREFECT_WORKER = "prefect-worker"  # a whole flow run in the pandastack work pool
    QUEUE = "queue"  # a queue message (pandastack_jobs.queue)
    CELERY = "celery"  # a Celery task call (pandastack_celery): run = task id, try = retries + 1


@dataclass(frozen=True)
class JobKey:
    """Names one attempt of one job, so a retry can find what an earlier attempt left.

    ``try_number`` is the attempt (Airflow's try_number, Prefect's run_count);
    everything else names the job across attempts.
    """

    engine: str
    workflow: str
    task: str
    run: str
    map_index: int = -1
    try_number: int = 1

    def __post_init__(self) -> None:
        for name in ("engine", "workflow", "task", "run"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise JobSpecError(f"key.{name}", f"{value!r} is empty", "give a non-empty string")
        if not isinstance(self.try_number, int) or self.try_number < 0:
            raise JobSpecError("key.try_number", f"{self.try_number!r} is invalid", "use an int >= 0")

    @property
    def job_id(self) -> str:
        """Stable across attempts: a hash of engine, workflow, task, run and map index."""
        raw = "\x1f".join((self.engine, self.workflow, self.task, self.run, str(self.map_index)))
        return hashlib.sha256(raw.encode()).hexdigest()[:24]

    @property
    def run_id(self) -> str:
        """Stable for every job of one workflow run (for sweeps)."""
        raw = "\x1f".join((self.engine, self.workflow, self.run))
        return hashlib.sha256(raw.encode()).hexdigest()[:24]

    def metadata(self) -> dict[str, str]:
        """The sandbox metadata that names this attempt (all values are strings)."""
        return {
            "managed_by": MANAGED_BY,
            "job_id": self.job_id,
            "job_run_id": self.run_id,
            "job_try": str(self.try_number),
            "job_engine": _clip(self.engine),
            "job_workflow": _clip(self.workflow),
            "job_task": _clip(self.task),
            "job_run": _clip(self.run),
            "job_map_index": str(self.map_index),
        }


def _clip(value: str) -> str:
    return value if len(value) <= METADATA_VALUE_MAX else value[: METADATA_VALUE_MAX - 1] + "…"


def _freeze_files(files: Mapping[str, FileContent] | None) -> Mapping[str, FileContent]:
    frozen: dict[str, FileContent] = {}
    for path, content in (files or {}).items():
        target = guest_path(path, f"files[{path!r}]")
        if isinstance(content, Path):
            if not content.is_file():
                raise JobSpecError(
                    f"files[{path!r}]", f"local file {str(content)!r} does not exist", "check the path"
                )
        elif not isinstance(content, (bytes, str)):
            raise JobSpecError(
                f"files[{path!r}]",
                f"content of type {type(content).__name__} cannot be delivered",
                "pass bytes, str, or a pathlib.Path to a local file",
            )
        if target in frozen:
            raise JobSpecError(f"files[{path!r}]", f"delivers to {target} twice", "keep one entry per path")
        frozen[target] = content
    return MappingProxyType(frozen)


def _freeze_str_map(value: Mapping[str, str] | None, field_name: str) -> Mapping[str, str]:
    out: dict[str, str] = {}
    for k, v in (value or {}).items():
        if not isinstance(k, str) or not k or not isinstance(v, str):
            raise JobSpecError(
                f"{field_name}[{k!r}]", "keys and values must be non-empty strings", "convert with str()"
            )
        out[k] = v
    return MappingProxyType(out)


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def option(default: Any = None, *, doc: str, factory: Callable[[], Any] | None = None) -> Any:
    """A :class:`JobSpec` field users set per job: its default and its docs line live here, once.

    Every adapter (Airflow operators, Prefect block and tasks, fork pools) derives
    its parameters from these fields (:func:`pandastack_jobs.job_options`).
    """
    meta = {"doc": doc}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class JobSpec:
    """One job: run ``command`` in a fresh sandbox and bring back its result.

    Files are delivered before the command runs (relative paths land under
    ``/work``); ``input`` is written as JSON to ``/work/input.json``; the job
    writes JSON to ``result_path`` and any extra ``collect`` paths are read back
    as bytes. ``timeout`` is the job's hard clock, enforced inside the guest.
    The fields made with :func:`option` are the job's options.
    """

    command: str
    files: Mapping[str, FileContent] = field(default_factory=dict)
    input: Any = None
    result_path: str | None = option(
        RESULT_PATH, doc="Where the job writes its JSON result (`$JOB_RESULT`); None: the job has no result."
    )
    collect: Sequence[str] = option((), doc="More sandbox paths read back as files when the job succeeds.")
    template: str = option(
        DEFAULT_TEMPLATE, doc="Sandbox template (image and size) the sandbox is made from."
    )
    timeout: float = option(
        DEFAULT_TIMEOUT, doc="The job's hard clock in seconds, enforced inside the sandbox (killed after it)."
    )
    ttl: int | None = option(
        None, doc="The sandbox's idle backstop in seconds; None: the timeout plus 60 seconds."
    )
    metadata: Mapping[str, str] = option(
        factory=dict, doc="Extra sandbox metadata, `{str: str}` (the attempt's own keys always win)."
    )
    env: Mapping[str, str] = option(
        factory=dict, doc="Environment variables of the job (never the orchestrator's own, never the key)."
    )
    key: JobKey | None = None
    permanent_exit_codes: Collection[int] = option(
        (), doc="Exit codes that mean the input can never succeed: dead-lettered, never retried."
    )
    retry_on_timeout: bool = option(
        True, doc="Whether a job that ran out of time is redelivered (False: dead-lettered)."
    )
    max_result_bytes: int = option(
        MAX_RESULT_BYTES, doc="The largest JSON result read back, in bytes (larger: dead-lettered)."
    )
    max_file_bytes: int = option(
        MAX_FILE_BYTES, doc="The largest file delivered or collected, in bytes (larger: dead-lettered)."
    )
    classifier: Classifier = field(default=cast(Classifier, None), compare=False)
    """The classifier of this job's failures: built from ``permanent_exit_codes`` and
    ``retry_on_timeout`` when left out; advanced: a custom :class:`Classifier` (then leave those
    two options unset)."""

    def __post_init__(self) -> None:
        if not isinstance(self.command, str) or not self.command.strip():
            raise JobSpecError("command", "is empty", "give the shell command to run, e.g. 'python3 run.py'")
        if (
            not isinstance(self.template, str)
            or not TEMPLATE_NAME.match(self.template)
            or self.template in ROUTE_NAMES
        ):
            raise JobSpecError(
                "template",
                f"{self.template!r} is not a valid template name",
                "use 1-64 characters from A-Z a-z 0-9 . _ - (not ., .. or builds), e.g. 'code-interpreter'",
            )
        if (
            not isinstance(self.timeout, (int, float))
            or isinstance(self.timeout, bool)
            or not math.isfinite(self.timeout)
            or self.timeout <= 0
        ):
            raise JobSpecError(
                "timeout", f"{self.timeout!r} is not a positive number", "give seconds, e.g. 120"
            )
        if self.ttl is not None and (not isinstance(self.ttl, int) or self.ttl < math.ceil(self.timeout)):
            raise JobSpecError(
                "ttl",
                f"{self.ttl!r} is shorter than the timeout ({self.timeout}s)",
                "leave ttl unset (it is derived from the timeout) or make it longer than the timeout",
            )
        for name in ("max_result_bytes", "max_file_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise JobSpecError(name, f"{value!r} is not a positive int", "give a size in bytes")
        object.__setattr__(self, "files", _freeze_files(self.files))
        object.__setattr__(self, "metadata", _freeze_str_map(self.metadata, "metadata"))
        env = _freeze_str_map(self.env, "env")
        for name in env:
            if not _ENV_NAME.match(name):
                raise JobSpecError(
                    f"env[{name!r}]", "is not a valid variable name", "use [A-Za-z_][A-Za-z0-9_]*"
                )
        object.__setattr__(self, "env", env)
        if self.input is not None:
            try:
                json.dumps(self.input, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise JobSpecError(
                    "input",
                    f"is not JSON-serialisable ({exc})",
                    "pass dicts, lists, str, int, float, bool, None",
                ) from None
        if self.result_path is not None:
            object.__setattr__(self, "result_path", guest_path(self.result_path, "result_path"))
        if isinstance(self.collect, str):
            raise JobSpecError("collect", "is a single string", "pass a list of paths, e.g. ['report.md']")
        object.__setattr__(
            self, "collect", tuple(guest_path(p, f"collect[{i}]") for i, p in enumerate(self.collect))
        )
        object.__setattr__(self, "classifier", self._classifier())

    def _classifier(self) -> Classifier:
        if self.classifier is None:
            if isinstance(self.permanent_exit_codes, (str, bytes)) or not isinstance(
                self.permanent_exit_codes, Collection
            ):
                raise JobSpecError(
                    "permanent_exit_codes", f"{self.permanent_exit_codes!r} is not a list", "pass e.g. [3, 4]"
                )
            if not isinstance(self.retry_on_timeout, bool):
                raise JobSpecError(
                    "retry_on_timeout", f"{self.retry_on_timeout!r} is not a bool", "True/False"
                )
            classifier = Classifier(frozenset(self.permanent_exit_codes), self.retry_on_timeout)
        elif not isinstance(self.classifier, Classifier):
            raise JobSpecError("classifier", "is not a Classifier", "use pandastack_jobs.Classifier(...)")
        elif (
            self.permanent_exit_codes
            and frozenset(self.permanent_exit_codes) != self.classifier.permanent_exit_codes
        ) or (not self.retry_on_timeout and self.classifier.retry_on_timeout):
            raise JobSpecError(
                "classifier",
                "is given together with permanent_exit_codes/retry_on_timeout",
                "put those into the Classifier, or drop the classifier",
            )
        else:
            classifier = self.classifier
        object.__setattr__(self, "permanent_exit_codes", classifier.permanent_exit_codes)
        object.__setattr__(self, "retry_on_timeout", classifier.retry_on_timeout)
        return classifier

    @property
    def rules(self) -> Classifier:
        """Deprecated: :attr:`classifier` (the same object)."""
        warnings.warn("JobSpec.rules is deprecated: use JobSpec.classifier", DeprecationWarning, stacklevel=2)
        return self.classifier

    @property
    def ttl_seconds(self) -> int:
        """The sandbox's idle backstop: explicit, or the timeout plus a margin."""
        if self.ttl is not None:
            return self.ttl
        return math.ceil(self.timeout) + TTL_MARGIN_SECONDS

    def sandbox_metadata(self) -> dict[str, str]:
        """Metadata for the sandbox: the user's, then the attempt's (which wins)."""
        merged = dict(self.metadata)
        if self.key is not None:
            merged.update(self.key.metadata())
        else:
            merged["managed_by"] = MANAGED_BY
        return merged
