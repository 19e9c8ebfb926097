"""The sandbox job block: one throwaway PandaStack sandbox per triggered job.

``PandaStackSandbox`` holds how a job runs (template, timeout, TTL, result
path, collected files, metadata, permanent exit codes, timeout policy);
``trigger()`` starts one job in a fresh sandbox and returns a
:class:`PandaStackSandboxRun` to ``wait_for_completion()`` and
``fetch_result()``. Used as a context manager, the block cancels (deletes the
sandbox of) every run still going when the ``with`` block exits, whatever the
reason; each run deletes its own sandbox when it ends.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Mapping
from contextlib import ExitStack
from types import TracebackType
from typing import Any, Optional

from prefect._internal.compatibility.async_dispatch import async_dispatch
from prefect.blocks.abstract import JobBlock, JobRun
from pydantic import Field, PrivateAttr
from typing_extensions import Unpack

from pandastack_jobs import (
    NOT_GIVEN,
    JobHandle,
    JobOptions,
    JobOutcome,
    admits_none,
    job_option,
    merge_options,
    option_names,
)

from .credentials import DOCS_URL, LOGO_URL, PandaStackCredentials
from .exceptions import SandboxJobFailed
from .execution import JobRequest, build_spec, execute
from .execution import job_name as resolve_job_name

PREFECT_OPTIONS = ("concurrency_limit", "publish_artifacts")
"""Block fields that are Prefect's own, not the job's (they go to :class:`JobRequest` as they are)."""


class SandboxOverrides(JobOptions, total=False):
    """What a call may override of a :class:`PandaStackSandbox`'s fields: the job's options
    (:class:`pandastack_jobs.JobOptions`) and Prefect's own (:data:`PREFECT_OPTIONS`).

    Left out (or :data:`~pandastack_jobs.NOT_GIVEN`): the block's value. ``None`` is a value where
    the field admits it (``ttl=None``: the timeout plus 60 s; ``result_path=None``: no result;
    ``concurrency_limit=None``: no limit); elsewhere it is read as left out.
    """

    concurrency_limit: Optional[str]
    publish_artifacts: bool


def option_field(name: str, default: Any = NOT_GIVEN, note: str = "", **constraints: Any) -> Any:
    """A pydantic field for the job option ``name``: default and description from the core.

    ``default`` replaces the declared one where an adapter needs its own (the worker's template);
    ``note`` is appended to the declared description (what the option means there)."""
    option = job_option(name)
    description = f"{option.doc} {note}".strip()
    if default is not NOT_GIVEN:
        return Field(default=default, description=description, **constraints)
    if option.shape == "scalar":
        return Field(default=option.default, description=description, **constraints)
    return Field(
        default_factory=dict if option.shape == "mapping" else list, description=description, **constraints
    )


class PandaStackSandboxRun(JobRun[Any]):
    """One job running in its own sandbox (started by :meth:`PandaStackSandbox.trigger`)."""

    def __init__(self, request: JobRequest) -> None:
        self.request = request
        self.handle = JobHandle()
        self.outcome: Optional[JobOutcome] = None
        self.error: Optional[BaseException] = None
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._run,), name="pandastack-job", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            self.outcome = execute(self.request, handle=self.handle, wait_for_retry=False)
        except SandboxJobFailed as exc:
            self.error = exc
        except BaseException as exc:  # noqa: BLE001 - handed to the caller in fetch_result
            self.error = exc

    @property
    def sandbox_id(self) -> Optional[str]:
        """The sandbox the job runs in, once it exists."""
        return self.handle.sandbox_id

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def cancel(self) -> None:
        """Stop the job: its sandbox is deleted now, and the run ends as cancelled."""
        self.handle.cancel()

    def _wait(self, timeout: Optional[float] = None) -> None:
        self._thread.join(timeout)

    async def await_for_completion(self) -> None:
        import anyio

        try:
            await anyio.to_thread.run_sync(self._thread.join, abandon_on_cancel=True)
        except BaseException:
            self.cancel()
            raise

    @async_dispatch(await_for_completion)
    def wait_for_completion(self) -> None:  # type: ignore[override]
        """Block until the job ended (its sandbox is deleted by then)."""
        try:
            self._wait()
        except BaseException:
            self.cancel()
            raise

    async def afetch_result(self) -> Any:
        await self.await_for_completion()
        return self._result()

    @async_dispatch(afetch_result)
    def fetch_result(self) -> Any:  # type: ignore[override]
        """The job's JSON result; raises :class:`SandboxJobFailed` if the job failed."""
        self.wait_for_completion(_sync=True)  # type: ignore[call-arg]
        return self._result()

    def _result(self) -> Any:
        if self.error is not None:
            raise self.error
        assert self.outcome is not None
        return self.outcome.result


class PandaStackSandbox(JobBlock[Any]):
    """Runs a command in a fresh PandaStack sandbox per job and brings back its JSON result.

    Every job gets its own microVM: created with a TTL backstop and metadata naming
    the attempt, given its files and JSON input, run under a hard timeout enforced
    inside the guest, its result read back, and deleted, always.
    """

    _block_type_name = "PandaStack Sandbox"
    _block_type_slug = "pandastack-sandbox"
    _logo_url = LOGO_URL  # type: ignore[assignment]
    _documentation_url = DOCS_URL  # type: ignore[assignment]
    _description = "Runs a job in a throwaway PandaStack sandbox (microVM) and returns its JSON result."
    _code_example = """
    ```python
    from prefect_blocks import PandaStackSandbox

    pandastack_sandbox_block = PandaStackSandbox.load("BLOCK_NAME")
    run = pandastack_sandbox_block.trigger(command="python3 run.py", files={"run.py": code})
    run.wait_for_completion()
    result = run.fetch_result()
    ```
    """

    credentials: PandaStackCredentials = Field(
        default_factory=PandaStackCredentials,
        description="Where the PandaStack server is and the API key to use.",
    )
    command: Optional[str] = Field(
        default=None,
        description="Shell command the job runs in /work; trigger(command=...) overrides it.",
        examples=["python3 run.py"],
    )
    # The job's options: one line each, type, default and description from the core's declaration.
    template: str = option_field("template")
    timeout: float = option_field("timeout", gt=0)
    ttl: Optional[int] = option_field("ttl")
    result_path: Optional[str] = option_field("result_path")
    collect: list[str] = option_field("collect")
    metadata: dict[str, str] = option_field("metadata")
    env: dict[str, str] = option_field("env")
    permanent_exit_codes: list[int] = option_field("permanent_exit_codes")
    retry_on_timeout: bool = option_field("retry_on_timeout")
    max_result_bytes: int = option_field("max_result_bytes", gt=0)
    max_file_bytes: int = option_field("max_file_bytes", gt=0)
    concurrency_limit: Optional[str] = Field(
        default=None,
        description="Name of a Prefect global concurrency limit that caps live sandboxes (one slot per job).",
    )
    publish_artifacts: bool = Field(
        default=True, description="Whether results, reports and dead-letters are published as artifacts."
    )

    _runs: list[PandaStackSandboxRun] = PrivateAttr(default_factory=list)
    _exit_stack: Optional[ExitStack] = PrivateAttr(default=None)

    def request(
        self,
        command: Optional[str] = None,
        *,
        files: Optional[Mapping[str, Any]] = None,
        input: Any = None,
        job_name: Optional[str] = None,
        artifact_key: Optional[str] = None,
        **overrides: Unpack[SandboxOverrides],
    ) -> JobRequest:
        """The job this block runs, with per-call ``overrides`` of its fields (left out: the
        block's), its :class:`~pandastack_jobs.JobSpec` built here, once, for the current attempt."""
        unknown = set(overrides) - set(option_names()) - set(PREFECT_OPTIONS)
        if unknown:
            raise TypeError(f"unknown sandbox option(s): {sorted(unknown)}")
        given = dict(overrides)
        prefect = {name: self._given_or_own(name, given.pop(name, NOT_GIVEN)) for name in PREFECT_OPTIONS}
        command = command or self.command
        if not command:
            raise ValueError("command: no command given; set it on the block or pass trigger(command=...)")
        options = merge_options({name: getattr(self, name) for name in option_names()}, given)
        return JobRequest(
            spec=build_spec(command, dict(files or {}), input, options, resolve_job_name(job_name)),
            credentials=self.credentials,
            job_name=job_name,
            artifact_key=artifact_key,
            **prefect,
        )

    def _given_or_own(self, name: str, value: Any) -> Any:
        """A call's value of Prefect's own field ``name``, or the block's when it was left out."""
        annotation = type(self).model_fields[name].annotation
        if value is NOT_GIVEN or (value is None and not admits_none(annotation)):
            return getattr(self, name)
        return value

    def _start(self, request: JobRequest) -> PandaStackSandboxRun:
        run = PandaStackSandboxRun(request)
        self._runs.append(run)
        if self._exit_stack is not None:
            self._exit_stack.callback(run.cancel)
        return run

    async def atrigger(
        self,
        command: Optional[str] = None,
        *,
        files: Optional[Mapping[str, Any]] = None,
        input: Any = None,
        **overrides: Unpack[SandboxOverrides],
    ) -> PandaStackSandboxRun:
        return self._start(self.request(command, files=files, input=input, **overrides))

    @async_dispatch(atrigger)
    def trigger(  # type: ignore[override]
        self,
        command: Optional[str] = None,
        *,
        files: Optional[Mapping[str, Any]] = None,
        input: Any = None,
        **overrides: Unpack[SandboxOverrides],
    ) -> PandaStackSandboxRun:
        """Start one job in a fresh sandbox; returns its run (call ``wait_for_completion()``)."""
        return self._start(self.request(command, files=files, input=input, **overrides))

    def run(
        self,
        command: Optional[str] = None,
        *,
        files: Optional[Mapping[str, Any]] = None,
        input: Any = None,
        **overrides: Unpack[SandboxOverrides],
    ) -> Any:
        """Run one job to its end in this thread and return its JSON result (or raise)."""
        outcome = execute(self.request(command, files=files, input=input, **overrides))
        return outcome.result

    def close(self) -> None:
        """Cancel every run this block started that is still going (their sandboxes are deleted)."""
        for run in self._runs:
            if not run.done:
                run.cancel()
        self._runs = [r for r in self._runs if not r.done]

    def __enter__(self) -> PandaStackSandbox:
        self._exit_stack = ExitStack()
        self._exit_stack.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        stack, self._exit_stack = self._exit_stack, None
        try:
            if stack is not None:
                stack.__exit__(exc_type, exc, tb)
        finally:
            self.close()
