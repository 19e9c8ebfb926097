"""Tasks: ``run_in_sandbox`` (sync), ``arun_in_sandbox`` (async) and the ``@sandbox_task`` decorator.

Each call is one sandbox lifecycle. The tasks retry only redeliverable failures
(:func:`~prefect_blocks.retries.retry_on_redeliver`, two retries by default,
our own jittered delay), never serve a cached result (``NO_CACHE``: a job has
side effects), and return the job's JSON result.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Optional, TypeVar, Union, cast, overload

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import Task
from typing_extensions import Unpack

from pandastack_jobs import JobHandle, function_job

from .credentials import PandaStackCredentials
from .execution import JobRequest, execute
from .retries import REDELIVERY_DELAY, retry_on_redeliver
from .sandbox import PandaStackSandbox, SandboxOverrides

DEFAULT_RETRIES = 2

R = TypeVar("R")

TASK_OPTIONS: dict[str, Any] = {
    "retries": DEFAULT_RETRIES,
    "retry_delay_seconds": REDELIVERY_DELAY,  # 0 to Prefect; the delay is ours: prefect_blocks.retries
    "retry_condition_fn": retry_on_redeliver,
    "cache_policy": NO_CACHE,
}


class RunOptions(SandboxOverrides, total=False):
    """The keyword arguments of :func:`run_in_sandbox`, :func:`arun_in_sandbox` and
    :func:`~prefect_blocks.run_in_fork`: the job's options and Prefect's own
    (:class:`~prefect_blocks.sandbox.SandboxOverrides`: left out, the block's value), and where the
    job comes from."""

    sandbox: Optional[PandaStackSandbox]
    """The block whose fields are the defaults (None: a default :class:`PandaStackSandbox`)."""
    credentials: Optional[PandaStackCredentials]
    """Overrides the block's credentials."""
    job_name: Optional[str]
    """Names the job's attempt (default: the task's name)."""
    artifact_key: Optional[str]
    """Key of the job's artifacts (default: from the job's name)."""


CALL_ONLY = ("sandbox", "credentials", "job_name", "artifact_key")
"""The keys of :class:`RunOptions` that are not a block's fields."""


def build_request(
    command: str,
    files: Optional[Mapping[str, Any]] = None,
    input: Any = None,
    **options: Unpack[RunOptions],
) -> JobRequest:
    """The job of one task call: ``sandbox``'s fields under the call's options (left out: kept)."""
    sandbox, credentials = options.get("sandbox"), options.get("credentials")
    block = sandbox if sandbox is not None else PandaStackSandbox()
    if credentials is not None:
        block = block.model_copy(update={"credentials": credentials})
    overrides = cast(SandboxOverrides, {k: v for k, v in options.items() if k not in CALL_ONLY})
    return block.request(
        command,
        files=files,
        input=input,
        job_name=options.get("job_name"),
        artifact_key=options.get("artifact_key"),
        **overrides,
    )


@task(name="run_in_sandbox", **TASK_OPTIONS)
def run_in_sandbox(
    command: str,
    files: Optional[Mapping[str, Any]] = None,
    input: Any = None,
    **options: Unpack[RunOptions],
) -> Any:
    """Run ``command`` in a fresh PandaStack sandbox and return its JSON result.

    ``files`` are written before the command runs (relative paths land in
    ``/work``), ``input`` is written as JSON to ``/work/input.json``, and the job
    writes its result as JSON to ``$JOB_RESULT`` (``/work/result.json``). The job
    options (``template``, ``timeout``, ``collect``, ...: :class:`RunOptions`,
    declared by :func:`pandastack_jobs.job_options`) left out come from ``sandbox``
    (a :class:`PandaStackSandbox` block) or its defaults. Raises
    :class:`~prefect_blocks.exceptions.SandboxJobFailed` on failure.
    """
    return execute(build_request(command, files, input, **options)).result


@task(name="arun_in_sandbox", **TASK_OPTIONS)
async def arun_in_sandbox(
    command: str,
    files: Optional[Mapping[str, Any]] = None,
    input: Any = None,
    **options: Unpack[RunOptions],
) -> Any:
    """Async form of :func:`run_in_sandbox`: the job runs in a worker thread; cancelling the
    task deletes the sandbox at once."""
    import anyio

    request = build_request(command, files, input, **options)
    handle = JobHandle()
    try:
        outcome = await anyio.to_thread.run_sync(
            functools.partial(execute, request, handle=handle), abandon_on_cancel=True
        )
    except BaseException:
        handle.cancel()
        raise
    return outcome.result


@overload
def sandbox_task(fn: Callable[..., R]) -> Task[..., R]: ...


@overload
def sandbox_task(
    fn: None = None,
    *,
    sandbox: Optional[PandaStackSandbox] = None,
    credentials: Optional[PandaStackCredentials] = None,
    **task_options: Any,
) -> Callable[[Callable[..., R]], Task[..., R]]: ...


def sandbox_task(
    fn: Optional[Callable[..., R]] = None,
    *,
    sandbox: Optional[PandaStackSandbox] = None,
    credentials: Optional[PandaStackCredentials] = None,
    **task_options: Any,
) -> Union[Task[..., R], Callable[[Callable[..., R]], Task[..., R]]]:
    """Make a Prefect task that runs the function's own source in a fresh sandbox.

    Arguments and the return value cross as JSON (never pickle): the function
    must be a plain ``def`` whose body imports what it needs. ``task_options``
    go to ``@task`` (``retries``, ``name``, ...) and default to redelivery retries
    and ``NO_CACHE``; sandbox options (``template``, ``timeout``, ...) come from
    ``sandbox``.
    """

    def decorate(func: Callable[..., R]) -> Task[..., R]:
        if inspect.iscoroutinefunction(func):
            raise TypeError("@sandbox_task: decorate a plain `def` function (it runs in the sandbox)")
        signature = inspect.signature(func)

        @functools.wraps(func)
        def body(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            job = function_job(func, bound.args, bound.kwargs)
            request = build_request(
                job["command"],
                job["files"],
                job["input"],
                sandbox=sandbox,
                credentials=credentials,
                result_path=job["result_path"],
                job_name=func.__name__,
            )
            return execute(request).result

        options = {**TASK_OPTIONS, "name": func.__name__, **task_options}
        return task(**options)(body)  # type: ignore[no-any-return]

    if fn is not None:
        return decorate(fn)
    return decorate
