"""Tasks: ``run_in_sandbox`` (sync), ``arun_in_sandbox`` (async) and the ``@sandbox_task`` decorator.

Each call is one sandbox lifecycle. The tasks retry only redeliverable failures
(:func:`~prefect_blocks.retries.retry_on_redeliver`, two retries by default,
our own jittered delay), never serve a cached result (``NO_CACHE``: a job has
side effects), and return the job's JSON result.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, TypeVar, Union, overload

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import Task

from pandastack_jobs import JobHandle, function_job

from .credentials import PandaStackCredentials
from .execution import JobRequest, execute
from .retries import REDELIVERY_DELAY, retry_on_redeliver
from .sandbox import PandaStackSandbox

DEFAULT_RETRIES = 2

R = TypeVar("R")

TASK_OPTIONS: dict[str, Any] = {
    "retries": DEFAULT_RETRIES,
    "retry_delay_seconds": REDELIVERY_DELAY,  # 0 to Prefect; the delay is ours: prefect_blocks.retries
    "retry_condition_fn": retry_on_redeliver,
    "cache_policy": NO_CACHE,
}


def build_request(
    command: str,
    files: Optional[Mapping[str, Any]],
    input: Any,
    sandbox: Optional[PandaStackSandbox],
    credentials: Optional[PandaStackCredentials],
    job_name: Optional[str],
    artifact_key: Optional[str],
    overrides: Mapping[str, Any],
) -> JobRequest:
    block = sandbox if sandbox is not None else PandaStackSandbox()
    if credentials is not None:
        block = block.model_copy(update={"credentials": credentials})
    return block.request(
        command, files=files, input=input, job_name=job_name, artifact_key=artifact_key, **overrides
    )


def job_overrides(**options: Any) -> dict[str, Any]:
    """The per-call options of a task as block overrides (None keeps the block's value)."""
    copies = {"collect": list, "permanent_exit_codes": list, "metadata": dict, "env": dict}
    return {
        name: (copies[name](value) if name in copies and value is not None else value)
        for name, value in options.items()
    }


@task(name="run_in_sandbox", **TASK_OPTIONS)
def run_in_sandbox(
    command: str,
    files: Optional[Mapping[str, Any]] = None,
    input: Any = None,
    *,
    sandbox: Optional[PandaStackSandbox] = None,
    credentials: Optional[PandaStackCredentials] = None,
    template: Optional[str] = None,
    timeout: Optional[float] = None,
    ttl: Optional[int] = None,
    result_path: Optional[str] = None,
    collect: Optional[Sequence[str]] = None,
    metadata: Optional[Mapping[str, str]] = None,
    env: Optional[Mapping[str, str]] = None,
    permanent_exit_codes: Optional[Sequence[int]] = None,
    retry_on_timeout: Optional[bool] = None,
    concurrency_limit: Optional[str] = None,
    job_name: Optional[str] = None,
    artifact_key: Optional[str] = None,
) -> Any:
    """Run ``command`` in a fresh PandaStack sandbox and return its JSON result.

    ``files`` are written before the command runs (relative paths land in
    ``/work``), ``input`` is written as JSON to ``/work/input.json``, and the job
    writes its result as JSON to ``$JOB_RESULT`` (``/work/result.json``). Options
    left as None come from ``sandbox`` (a :class:`PandaStackSandbox` block) or its
    defaults. Raises :class:`~prefect_blocks.errors.SandboxJobFailed` on failure.
    """
    overrides = job_overrides(
        template=template,
        timeout=timeout,
        ttl=ttl,
        result_path=result_path,
        collect=collect,
        metadata=metadata,
        env=env,
        permanent_exit_codes=permanent_exit_codes,
        retry_on_timeout=retry_on_timeout,
        concurrency_limit=concurrency_limit,
    )
    request = build_request(command, files, input, sandbox, credentials, job_name, artifact_key, overrides)
    return execute(request).result


@task(name="arun_in_sandbox", **TASK_OPTIONS)
async def arun_in_sandbox(
    command: str,
    files: Optional[Mapping[str, Any]] = None,
    input: Any = None,
    *,
    sandbox: Optional[PandaStackSandbox] = None,
    credentials: Optional[PandaStackCredentials] = None,
    template: Optional[str] = None,
    timeout: Optional[float] = None,
    ttl: Optional[int] = None,
    result_path: Optional[str] = None,
    collect: Optional[Sequence[str]] = None,
    metadata: Optional[Mapping[str, str]] = None,
    env: Optional[Mapping[str, str]] = None,
    permanent_exit_codes: Optional[Sequence[int]] = None,
    retry_on_timeout: Optional[bool] = None,
    concurrency_limit: Optional[str] = None,
    job_name: Optional[str] = None,
    artifact_key: Optional[str] = None,
) -> Any:
    """Async form of :func:`run_in_sandbox`: the job runs in a worker thread; cancelling the
    task deletes the sandbox at once."""
    import anyio

    overrides = job_overrides(
        template=template,
        timeout=timeout,
        ttl=ttl,
        result_path=result_path,
        collect=collect,
        metadata=metadata,
        env=env,
        permanent_exit_codes=permanent_exit_codes,
        retry_on_timeout=retry_on_timeout,
        concurrency_limit=concurrency_limit,
    )
    request = build_request(command, files, input, sandbox, credentials, job_name, artifact_key, overrides)
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
            block = sandbox if sandbox is not None else PandaStackSandbox()
            if credentials is not None:
                block = block.model_copy(update={"credentials": credentials})
            request = block.request(
                job["command"],
                files=job["files"],
                input=job["input"],
                result_path=job["result_path"],
                job_name=func.__name__,
            )
            return execute(request).result

        options = {**TASK_OPTIONS, "name": func.__name__, **task_options}
        return task(**options)(body)  # type: ignore[no-any-return]

    if fn is not None:
        return decorate(fn)
    return decorate
