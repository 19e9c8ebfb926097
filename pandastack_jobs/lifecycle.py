"""The one sandbox lifecycle: create → deliver → exec under a hard timeout → collect → delete.

Three rails: the guest-side timeout (the server's is not
trusted), a TTL backstop on every sandbox, and "ack only after the result is
out": success means the result was read back, anything else is a classified
failure. The sandbox is deleted in ``finally``, always; a failed delete after a
good result is logged, never turned into a failure (the TTL and the sweep
catch it).
"""

from __future__ import annotations

import json
import logging
import shlex
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import pandastack
from pandastack import Sandbox

from . import guest, tracing
from .connection import reset_refusals
from .execstream import exec_stream
from .failures import StepError, capacity_retry_after, describe_exit, kind_for_error, last_line
from .outcome import FailureKind, JobOutcome, Timings
from .reaper import delete_sandbox, earlier_attempts, reap_best_effort
from .redact import Redactor
from .spec import TAIL_BYTES, WORKDIR, JobSpec
from .trailer import TrailerReader

logger = logging.getLogger(__name__)

OutputCallback = Callable[[str, str], None]
"""Called with ``(stream, chunk)`` as the job's output arrives; stream is "stdout" or "stderr"."""
CreatedCallback = Callable[[str], None]
"""Called with the sandbox id right after create, before any job code runs."""


class StandbySandbox(Protocol):
    """What a job needs of a standby (``warm_start.Standby``, which builds on this module): the id of
    the ready sandbox it takes over."""

    @property
    def sandbox_id(self) -> str: ...


class JobHandle:
    """Lets another thread stop a running job: an engine's ``on_kill`` or cancellation hook.

    ``cancel()`` deletes the sandbox at once; the job then ends as
    ``CANCELLED`` (dead-letter), never as a success.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._client: pandastack.Client | None = None
        self.sandbox_id: str | None = None
        self.cancelled = False

    def attach(self, client: pandastack.Client, sandbox_id: str) -> None:
        """Record the running job's sandbox (done by the runner right after create)."""
        with self._lock:
            self._client, self.sandbox_id = client, sandbox_id
            cancelled = self.cancelled
        if cancelled:
            delete_sandbox(client, sandbox_id)

    def cancel(self) -> None:
        """Stop the job: mark it cancelled and delete its sandbox (idempotent)."""
        with self._lock:
            self.cancelled = True
            client, sandbox_id = self._client, self.sandbox_id
        if client is not None and sandbox_id is not None:
            delete_sandbox(client, sandbox_id)


class OutputTail:
    """Keeps the last ``limit`` characters of a stream, however much the job prints."""

    def __init__(self, limit: int = TAIL_BYTES) -> None:
        self._limit = limit
        self._chunks: deque[str] = deque()
        self._size = 0

    def add(self, chunk: str) -> None:
        """Append ``chunk``, dropping whole old chunks once the tail is long enough."""
        self._chunks.append(chunk)
        self._size += len(chunk)
        while self._size - len(self._chunks[0]) >= self._limit and len(self._chunks) > 1:
            self._size -= len(self._chunks.popleft())

    def text(self) -> str:
        """The last ``limit`` characters seen."""
        return "".join(self._chunks)[-self._limit :]


class JobRun:
    """One run of one job in one sandbox. Use :func:`run_job`; the fork pool reuses the steps."""

    def __init__(
        self,
        client: pandastack.Client,
        spec: JobSpec,
        *,
        on_created: CreatedCallback | None = None,
        on_output: OutputCallback | None = None,
        handle: JobHandle | None = None,
        redactor: Redactor | None = None,
        keep_on_success: bool = False,
        workdir: str = WORKDIR,
    ) -> None:
        self.client = client
        self.workdir = workdir  # another only for a queue chunk's mates (their own directory each)
        self.keep_on_success = keep_on_success
        self.succeeded = False
        self.spec = spec
        self.on_created = on_created
        self.on_output = on_output
        self.handle = handle or JobHandle()
        self.redact = redactor or Redactor()
        self.redact.add(getattr(client, "api_key", None))
        self.stdout = OutputTail()
        self.stderr = OutputTail()
        self.times: dict[str, float] = {}
        self.sandbox: Sandbox | None = None
        self._folded: _Folded | None = None
        self.command = spec.command
        """What the exec step runs: the spec's command, or a standby's warm command once taken."""
        self.warm: bool | None = None
        """With a standby: True once it was taken, False when it was gone and the job went cold."""

    # -- the steps -------------------------------------------------------------------------------

    def create(self) -> Sandbox:
        """A fresh sandbox with the TTL backstop and metadata naming the attempt."""
        reset_refusals()
        return self.client.sandboxes.create(
            template=self.spec.template,
            ttl_seconds=self.spec.ttl_seconds,
            metadata=self.spec.sandbox_metadata(),
        )

    def take_standby(self, sandbox_id: str, command: str) -> Sandbox:
        """The acquire step of a warm start: the standby ``sandbox_id``, given the job's TTL, runs
        ``command``; if the standby is gone, a fresh sandbox from the cold spec runs the cold command.

        The PATCH of the TTL is the one round trip that both claims the standby (a waiting
        standby's TTL is short) and proves it still exists.
        """
        sb = Sandbox.from_dict({"id": sandbox_id}, client=self.client)  # a handle: no lookup
        try:
            sb.set_ttl(self.spec.ttl_seconds)
        except pandastack.NotFoundError:
            logger.info("pandastack: standby %s is gone; the job runs cold in a fresh sandbox", sandbox_id)
            self.warm = False
            return self.create()
        self.warm = True
        self.command = command
        return sb

    def deliver(self, sb: Sandbox) -> None:
        """Write the job's files and its JSON input into the guest.

        When the job's exec is folded (:meth:`fold`), small text files were taken into
        its command instead and only the rest is written here.
        """
        payloads = self._folded.rest if self._folded is not None else self._payloads()
        for path, data in payloads:
            sb.filesystem.write(path, data)

    def fold(self) -> None:
        """Plan one exec for a fresh sandbox: it writes the small files, runs the job and sends
        the result back on its stdout (:func:`guest.job_script`). Saves the input write, the
        result's stat and read: three round trips. Large or binary files still go by PUT."""
        budget = INLINE_BYTES
        writes: dict[str, str] = {}
        rest: list[tuple[str, bytes]] = []
        for path, data in self._payloads():
            text = _inline_text(data)
            cost = len(shlex.quote(text).encode()) + len(path) if text is not None else budget + 1
            if text is not None and cost <= budget:
                writes[path] = text
                budget -= cost
            else:
                rest.append((path, data))
        trailer = None
        if self.spec.result_path is not None:
            limit = min(self.spec.max_result_bytes, FAST_RESULT_BYTES)
            trailer = guest.ResultTrailer(self.spec.result_path, limit)
        self._folded = _Folded(writes, rest, trailer)

    def _payloads(self) -> list[tuple[str, bytes]]:
        """(guest path, bytes) of every file and the input, checked against the upload limit."""
        out: list[tuple[str, bytes]] = []
        for path, content in self.spec.files.items():
            data = content.read_bytes() if isinstance(content, Path) else content
            data = data.encode() if isinstance(data, str) else data
            if len(data) > self.spec.max_file_bytes:
                raise StepError(
                    FailureKind.BAD_REQUEST,
                    f"file {path} is {len(data)} bytes, over the {self.spec.max_file_bytes}-byte upload "
                    "limit: ship large inputs through object storage and fetch them in the job",
                )
            out.append((path, data))
        if self.spec.input is not None:
            out.append(
                (guest.input_path(self.workdir), json.dumps(self.spec.input, allow_nan=False).encode())
            )
        return out

    def execute(self, sb: Sandbox) -> tuple[int, float]:
        """Run the command under the guest-side clock; return (exit code, seconds).

        The output streams through :func:`.execstream.exec_stream`, which keeps none of it
        (the SDK's ``exec_stream`` keeps all of it)."""
        env = guest.job_env(self.spec.result_path, self.spec.env, self.workdir)
        folded = self._folded
        on_stdout: Callable[[str], None] = lambda chunk: self.output("stdout", chunk)  # noqa: E731
        if folded is None:
            command = guest.foreground_command(self.command, self.spec.timeout, env, self.workdir)
        else:
            command = guest.job_script(
                self.command, self.spec.timeout, env, folded.writes, folded.trailer, self.workdir
            )
            on_stdout = folded.reader_for(on_stdout)
        started = time.monotonic()
        try:
            exit_code = exec_stream(
                sb,
                command,
                on_stdout=on_stdout,
                on_stderr=lambda chunk: self.output("stderr", chunk),
                timeout_seconds=guest.server_timeout(self.spec.timeout),
            )
        finally:
            if folded is not None and folded.reader is not None:
                folded.reader.finish()
        return exit_code, time.monotonic() - started

    def collect(self, sb: Sandbox) -> tuple[Any, bool, dict[str, bytes]]:
        """Read back the JSON result and the collected files (size-capped, JSON only)."""
        result: Any = None
        has_result = False
        if self.spec.result_path is not None:
            raw = self._folded.result() if self._folded is not None else None
            if raw is not None:
                try:
                    result = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
                    return result, True, self._collect_files(sb)
                except (UnicodeDecodeError, ValueError, RecursionError):
                    # Mixed with a background process's output, say: the file itself decides.
                    pass
            # No fast answer (or none that decodes): stat, check and read the file, naming what is wrong.
            raw = self._read_capped(sb, self.spec.result_path, self.spec.max_result_bytes, "result")
            try:
                result = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
            except (UnicodeDecodeError, ValueError) as exc:
                raise StepError(
                    FailureKind.RESULT_INVALID,
                    f"result file {self.spec.result_path} is not valid JSON ({exc}); "
                    "write it with json.dump(...) in the job",
                ) from None
            except RecursionError:  # the job's bytes, nested past the decoder's depth
                raise StepError(
                    FailureKind.RESULT_INVALID,
                    f"result file {self.spec.result_path} is too deeply nested to decode; "
                    "write a flatter JSON document",
                ) from None
            has_result = True
        return result, has_result, self._collect_files(sb)

    def _collect_files(self, sb: Sandbox) -> dict[str, bytes]:
        return {
            p: self._read_capped(sb, p, self.spec.max_file_bytes, "collected file") for p in self.spec.collect
        }

    def teardown(self) -> str | None:
        """Delete the sandbox; return the error text if that failed (404 counts as deleted)."""
        if self.sandbox is None or (self.keep_on_success and self.succeeded):
            return None
        try:
            delete_sandbox(self.client, self.sandbox.id, raise_errors=True)
        except Exception as exc:  # noqa: BLE001 - a failed delete must never fail the job
            text = self.redact(f"{type(exc).__name__}: {exc}")
            logger.warning(
                "pandastack: could not delete sandbox %s (TTL will reap it): %s", self.sandbox.id, text
            )
            return text
        return None

    # -- the whole run ---------------------------------------------------------------------------

    def run(self, acquire: Callable[[], Sandbox] | None = None, **steps: Any) -> JobOutcome:
        """:meth:`_run` in a ``pandastack.job`` span (pandastack_jobs/tracing.py), its steps as children."""
        with tracing.job_span(self.spec) as span:
            outcome = self._run(acquire, **steps)
            tracing.end_job(span, outcome)
            return outcome

    def _run(
        self,
        acquire: Callable[[], Sandbox] | None = None,
        *,
        deliver: bool = True,
        execute: Callable[[Sandbox], tuple[int, float]] | None = None,
        collect: bool = True,
        fresh: bool | None = None,
    ) -> JobOutcome:
        """Run the steps; classify whatever goes wrong; always tear down.

        ``acquire`` replaces create (a fork, an existing sandbox, a standby), ``execute``
        replaces the exec step (detached launch or reading a detached job's end),
        and ``deliver``/``collect`` switch those steps off. ``fresh``: the sandbox
        acquired is one nothing but this job has touched (a standby), so the job's
        exec may be folded as a created one's is (default: only without ``acquire``).
        """
        started = time.monotonic()
        step = "create"
        outcome_kw: dict[str, Any] = {}
        try:
            if (acquire is None if fresh is None else fresh) and deliver and execute is None and collect:
                self.fold()  # a fresh sandbox: nothing but this job has touched its files
            self.sandbox = self._timed("create", acquire or self.create)
            self.handle.attach(self.client, self.sandbox.id)
            if self.on_created is not None:
                self.on_created(self.sandbox.id)
            if deliver:
                step = "deliver"
                self._timed("deliver", lambda: self.deliver(self._live()))
            step = "exec"
            exit_code, elapsed = self._timed("exec", lambda: (execute or self.execute)(self._live()))
            outcome_kw["exit_code"] = exit_code
            if exit_code != 0:
                raise self._exit_failure(exit_code, elapsed)
            if collect:
                step = "collect"
                result, has_result, files = self._timed("collect", lambda: self.collect(self._live()))
                outcome_kw.update(result=result, has_result=has_result, files=files)
            outcome_kw.update(ok=True, reason="succeeded")
            self.succeeded = True
        except Exception as exc:
            kind = FailureKind.CANCELLED if self.handle.cancelled else kind_for_error(exc, step)
            if kind is None:
                self._finish_teardown()
                raise
            if kind is FailureKind.SERVER_ERROR and self.sandbox is None and acquire is None:
                # The wire has no status of its own for an unknown template (a 5xx): ask.
                if _template_missing(self.client, self.spec.template):
                    kind = FailureKind.UNKNOWN_TEMPLATE
            if kind is FailureKind.SERVER_ERROR and self.sandbox is not None:
                # A 5xx mid-job is often the sandbox dying under it: say so when it is gone.
                if not _sandbox_exists(self.client, self.sandbox.id):
                    kind = FailureKind.SANDBOX_LOST
            outcome_kw.update(self._failure(kind, exc, step, outcome_kw.get("exit_code")))
        except BaseException:
            # Ctrl-C or an engine's termination signal mid-job: delete, then let it propagate.
            self.succeeded = False
            self._finish_teardown()
            raise
        teardown_error = self._finish_teardown()
        self.times["total"] = time.monotonic() - started
        key = self.spec.key
        return JobOutcome(
            stdout_tail=self.redact(self.stdout.text()),
            stderr_tail=self.redact(self.stderr.text()),
            sandbox_id=self.sandbox.id if self.sandbox else None,
            timings=Timings(**self.times),
            teardown_error=teardown_error,
            job_id=key.job_id if key else None,
            try_number=key.try_number if key else None,
            standby=self.warm,
            **outcome_kw,
        )

    # -- helpers ---------------------------------------------------------------------------------

    def _live(self) -> Sandbox:
        if self.handle.cancelled:
            raise StepError(FailureKind.CANCELLED, "job was cancelled; its sandbox was deleted")
        assert self.sandbox is not None
        return self.sandbox

    def _timed(self, name: str, fn: Callable[[], Any]) -> Any:
        started = time.monotonic()
        try:
            with tracing.step_span(name):
                return fn()
        finally:
            self.times[name] = time.monotonic() - started

    def _finish_teardown(self) -> str | None:
        started = time.monotonic()
        with tracing.step_span("delete"):
            error = self.teardown()
        self.times["delete"] = time.monotonic() - started
        return error

    def output(self, stream: str, chunk: str) -> None:
        """Record a chunk of the job's output: kept in the outcome's tail, passed on redacted.

        The exec step calls it as output streams in; a replaced exec step (a detached
        job's end) calls it with what it read back.
        """
        (self.stdout if stream == "stdout" else self.stderr).add(chunk)
        if self.on_output is not None:
            self.on_output(stream, self.redact(chunk))

    def _read_capped(self, sb: Sandbox, path: str, limit: int, what: str) -> bytes:
        try:
            info = sb.filesystem.stat(path)
        except pandastack.NotFoundError:
            if sb.id and not _sandbox_exists(self.client, sb.id):
                raise
            raise StepError(
                FailureKind.RESULT_MISSING,
                f"the job exited 0 but wrote no {what} at {path}; write it before exiting",
            ) from None
        if info.is_dir or not _is_regular(info.mode):
            # A device, FIFO or socket (a symlink to /dev/zero stats as its target): reading it
            # could stream forever or hang; only a regular file is a result.
            raise StepError(
                FailureKind.RESULT_INVALID,
                f"{what} {path} is not a regular file (mode {info.mode or 'directory'}); "
                "write it as a regular file",
            )
        if info.size > limit:
            raise StepError(
                FailureKind.RESULT_TOO_LARGE,
                f"{what} {path} is {info.size} bytes, over the {limit}-byte cap; "
                "write large outputs to object storage, or raise the cap",
            )
        data = sb.filesystem.read(path)
        if len(data) > limit:  # the file grew after the stat
            raise StepError(FailureKind.RESULT_TOO_LARGE, f"{what} {path} grew past the {limit}-byte cap")
        return data

    def _exit_failure(self, exit_code: int, elapsed: float) -> StepError:
        if guest.timed_out(exit_code, elapsed, self.spec.timeout):
            return StepError(
                FailureKind.TIMEOUT,
                f"job exceeded its {self.spec.timeout:g}s timeout and was killed",
            )
        kind = self.spec.classifier.kind_for_exit(exit_code)
        cause = last_line(self.redact(self.stderr.text()))
        label = "permanent " if kind is FailureKind.PERMANENT_EXIT_CODE else ""
        return StepError(
            kind, f"job failed with {label}{describe_exit(exit_code)}" + (f": {cause}" if cause else "")
        )

    def _failure(self, kind: FailureKind, exc: Exception, step: str, exit_code: int | None) -> dict[str, Any]:
        if isinstance(exc, StepError):
            reason = exc.reason
        elif kind is FailureKind.TIMEOUT:
            reason = f"job exceeded its {self.spec.timeout:g}s timeout (the server stopped it)"
        elif kind is FailureKind.CANCELLED:
            reason = "job was cancelled; its sandbox was deleted"
        elif kind is FailureKind.UNKNOWN_TEMPLATE:
            reason = f"template {self.spec.template!r} cannot be used: {exc}"
        else:
            reason = f"{step} failed ({type(exc).__name__}): {exc}"
        retry_after = capacity_retry_after(exc) if kind is FailureKind.CAPACITY else None
        return {
            "ok": False,
            "kind": kind,
            "failure_class": self.spec.classifier.classify(kind, exit_code),
            "reason": self.redact(reason),
            "retry_after": retry_after,
        }


# Files and input up to this much (shell-quoted) ride in the job's exec line: the kernel's limit
# for one argument is 128 KiB, and the server logs the line's start only.
INLINE_BYTES = 48 * 1024
# Results up to this much come back on the exec's stdout; a larger one is stat'ed and read.
FAST_RESULT_BYTES = 1024 * 1024


def _inline_text(data: bytes) -> str | None:
    """``data`` as text a shell argument can carry (UTF-8, no NUL), or None."""
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


class _Folded:
    """A folded job's plan: the files its exec writes and where its result comes back."""

    def __init__(
        self, writes: dict[str, str], rest: list[tuple[str, bytes]], trailer: guest.ResultTrailer | None
    ) -> None:
        self.writes = writes
        self.rest = rest
        self.trailer = trailer
        self.reader: TrailerReader | None = None

    def reader_for(self, emit: Callable[[str], None]) -> Callable[[str], None]:
        """The stdout callback: the job's output to ``emit``, the trailer kept aside."""
        if self.trailer is None:
            return emit
        self.reader = TrailerReader(self.trailer, emit)
        return self.reader.add

    def result(self) -> bytes | None:
        return self.reader.result() if self.reader is not None else None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Statuses of a sandbox that can no longer run the job (the API's `failed`: its processes died).
_LOST_STATUSES = frozenset({"failed", "stopping", "deleted"})


def _template_missing(client: pandastack.Client, template: str) -> bool:
    """True only when the templates API answers 404 for ``template`` (anything else, an unreachable
    server included, proves nothing: the create's failure stays a server error)."""
    try:
        client.templates.get(template)
    except pandastack.NotFoundError:
        return True
    except (pandastack.PandastackError, OSError, AttributeError, KeyError, TypeError, ValueError):
        # An answer that is not a template (another route's) proves nothing either, and must not
        # escape run_job.
        return False
    return False


def _sandbox_exists(client: pandastack.Client, sandbox_id: str) -> bool:
    """False only when the server says the sandbox is gone or dead (an unreachable server proves
    nothing)."""
    try:
        sb = client.sandboxes.get(sandbox_id)
    except pandastack.NotFoundError:
        return False
    except (pandastack.PandastackError, OSError):
        return True
    return str(getattr(sb, "status", "") or "").lower() not in _LOST_STATUSES


def reap_before(client: pandastack.Client, spec: JobSpec) -> list[str]:
    """Delete what earlier attempts of ``spec.key`` left (a worker killed mid-job), before a new one.

    Best effort: if the server cannot be asked, the new attempt goes ahead and
    the TTL backstop catches any orphan.
    """
    if spec.key is None:
        return []
    return reap_best_effort(client, earlier_attempts(spec.key), "orphans of earlier attempts")


def run_job(
    client: pandastack.Client,
    spec: JobSpec,
    *,
    on_created: CreatedCallback | None = None,
    on_output: OutputCallback | None = None,
    handle: JobHandle | None = None,
    redactor: Redactor | None = None,
    reap: bool = True,
    standby: StandbySandbox | None = None,
    standby_command: str | None = None,
) -> JobOutcome:
    """Run ``spec`` in exactly one fresh sandbox and return what came of it.

    Before creating, sandboxes left by earlier attempts of the same job
    (``spec.key``) are deleted. Job failures are returned as a classified
    :class:`JobOutcome`, never raised; only programming errors propagate.

    With a ``standby`` (:meth:`.StandbyPool.take`), ``spec`` is still the COLD spec: the
    standby's sandbox is used instead of creating one, its TTL set to ``spec.ttl_seconds``, and
    ``standby_command`` (``standby.command(argv)``) runs under all the usual rails; if the standby
    is gone, a fresh sandbox runs ``spec.command``.
    """
    if reap:
        reap_before(client, spec)
    run = JobRun(client, spec, on_created=on_created, on_output=on_output, handle=handle, redactor=redactor)
    return run.run(**standby_steps(run, standby, standby_command))


def standby_steps(run: JobRun, standby: StandbySandbox | None, command: str | None) -> dict[str, Any]:
    """The :meth:`JobRun.run` arguments that take ``standby`` (none without one)."""
    if standby is None:
        return {}
    if not command:
        raise ValueError("standby_command: give standby.command(argv) with a standby")
    sandbox_id, warm_command = standby.sandbox_id, command
    return {"acquire": lambda: run.take_standby(sandbox_id, warm_command), "fresh": True}


def _is_regular(mode: str | None) -> bool:
    """A regular file by ``stat``'s ``mode``: PandaStack reports the type letter (``f``, as
    ``find -printf %y``); an ``ls``-style ``-rw-r--r--`` is accepted too; no mode says nothing."""
    return not mode or mode == "f" or mode.startswith("-")
