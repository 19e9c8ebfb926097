"""``SandboxTask`` and ``@sandbox_task``: a Celery task whose body runs as one job in a fresh sandbox.

The lifecycle is the core's (:func:`pandastack_jobs.run_job`); this module only translates:

- the call: the function's own source runs in the sandbox, its arguments cross as JSON (never
  pickle: a task or app that would pickle is refused, naming the setting);
- the attempt: the job key carries Celery's task id and retry count, so a retry or a redelivery
  deletes what an earlier attempt left (a redelivery after a lost worker repeats the retry count,
  so on a delivery the broker marks as redelivered this try's own earlier sandbox is deleted too);
- the delivery cap: Celery counts no redeliveries, so a try whose worker dies every time would be
  requeued forever; the worker counts each try's deliveries in the result backend before the
  sandbox starts (nothing the producer writes) and fails it as a dead-letter past ``max_deliveries``;
- the outcome: the JSON result is the task's return value (Celery's result backend keeps it), a
  redeliverable failure is ``Task.retry`` (countdown at least the capacity ``Retry-After``), a
  dead-letter fails at once with the reason;
- Celery's limits: ``acks_late`` and ``reject_on_worker_lost`` are on, ``soft_time_limit`` and
  ``time_limit`` shorten the job's guest clock so the job is stopped (and its sandbox deleted)
  before Celery's own limit fires, and the SIGTERM of ``revoke(terminate=True)`` unwinds the job
  through the core's teardown, which deletes the sandbox before the pool process exits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Optional, TypeVar, Union, overload

from celery import Celery, Task

from pandastack_jobs import ConnectionConfig, Engine, FailureKind, JobKey, JobOutcome, JobSpec
from pandastack_jobs.lifecycle import run_job
from pandastack_jobs.options import coerce_options, option_names, validate_options
from pandastack_jobs.pyfunc import check_json, function_job
from pandastack_jobs.reaper import earlier_attempts, reap_best_effort, redelivered_attempts

from .exceptions import SandboxJobFailed, SandboxTaskConfigError

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_RETRY_DELAY = 2.0
"""Seconds before a redeliverable failure's retry (Celery's own default, 180 s, is for flaky
networks; a fresh sandbox can start at once). A capacity refusal waits its ``Retry-After`` if longer."""
DEFAULT_MAX_RETRIES = 3
DEFAULT_MAX_DELIVERIES = 5
"""Deliveries of one try (a task id and retry count) before it fails as a dead-letter: the queue
consumer's ``max_deliveries`` default."""
DELIVERY_COUNT_SECONDS = 7 * 24 * 3600
"""How long the result backend keeps a try's delivery count (a redelivery comes within the
broker's visibility timeout or a worker restart; a week is far past either)."""

SANDBOX_SETTINGS: dict[str, Any] = {
    "task_serializer": "json",
    "result_serializer": "json",
    "accept_content": ["json"],
    "result_accept_content": ["json"],
    # A pool process holds one task at a time: a prefetched message waits unacked behind a long one.
    "worker_prefetch_multiplier": 1,
    # On a lost broker connection an acks_late task can no longer be acked and comes back anyway:
    # cancel it (its sandbox is deleted) instead of running it twice.
    "worker_cancel_long_running_tasks_on_connection_loss": True,
}
"""The app settings sandbox tasks are tested with: ``app.conf.update(SANDBOX_SETTINGS)``."""


def clock_margin(limit: float) -> float:
    """How long before a Celery time limit the job's guest clock stops it: room to read the
    outcome and delete the sandbox before Celery raises or kills the pool process."""
    return max(2.0, 0.1 * limit)


def guest_clock(
    timeout: float, soft: Optional[float], hard: Optional[float], elapsed: float = 0.0
) -> tuple[float, Optional[float]]:
    """The job's clock and the Celery limit that set it (None: the job's own ``timeout`` did).

    ``elapsed``: seconds the task already ran before the job starts (they count against Celery's
    limits, not against the job's own timeout).
    """
    limits = [x for x in (soft, hard) if x]
    if not limits:
        return timeout, None
    limit = min(limits)
    clock = limit - clock_margin(limit) - elapsed
    if clock >= timeout:
        return timeout, None
    if clock < 1.0:
        raise SandboxTaskConfigError(
            f"soft_time_limit/time_limit={limit:g}s leaves the job {clock:.1f}s once the "
            f"{clock_margin(limit):g}s margin is kept: give the task a time limit of at least "
            f"{elapsed + 1 + clock_margin(limit):.0f}s"
        )
    return clock, limit


def check_serializer(setting: str, value: Any) -> None:
    """Refuse any serializer but JSON: a sandbox task's arguments and result are JSON only."""
    if value not in (None, "json"):
        raise SandboxTaskConfigError(
            f"{setting}={value!r}: a sandbox task crosses the sandbox wall as JSON and is never "
            f"pickled; set {setting}='json' (or leave it out: Celery's default is json)"
        )


class SandboxTask(Task):  # type: ignore[misc]
    """A Celery task base: ``@app.task(base=SandboxTask)`` runs the function's body in a fresh
    sandbox. Job options go in ``job_options`` (``{"template": ..., "timeout": ...}``, the core's
    names); the PandaStack connection in ``connection`` (default: the SDK's environment,
    ``PANDASTACK_API`` and ``PANDASTACK_API_KEY``)."""

    acks_late = True
    """Acked after the result is stored: a worker that dies mid-task leaves it for another."""
    reject_on_worker_lost = True
    """A pool process killed mid-task (the OOM killer, a SIGKILL) requeues the message."""
    serializer = "json"
    default_retry_delay = DEFAULT_RETRY_DELAY
    max_retries = DEFAULT_MAX_RETRIES
    max_deliveries: Optional[int] = DEFAULT_MAX_DELIVERIES
    """Deliveries of one try before it fails as a dead-letter (kind ``max_deliveries``) without
    running; None: no cap. Counted in the result backend (one that can count: Redis, memcached,
    the cache backends; with another, e.g. ``rpc://`` or a database, there is no cap and the
    worker says so in its log once)."""
    job_options: Mapping[str, Any] = {}
    connection: Optional[ConnectionConfig] = None

    # -- the producer side -------------------------------------------------------------------

    def apply_async(self, args: Any = None, kwargs: Any = None, *rest: Any, **options: Any) -> Any:
        """Celery's ``apply_async``, refusing at once what a sandbox could never take: a pickle
        serializer, and arguments that are not JSON."""
        check_serializer("serializer", options.get("serializer") or self.serializer)
        for i, arg in enumerate(args or ()):
            check_json(arg, f"args[{i}]")
        for name, arg in (kwargs or {}).items():
            check_json(arg, f"kwargs[{name!r}]")
        return super().apply_async(args, kwargs, *rest, **options)

    # -- the worker side ---------------------------------------------------------------------

    def function(self) -> Callable[..., Any]:
        """The plain function whose source runs in the sandbox."""
        run = _static_run(type(self))
        if run is None:
            raise SandboxTaskConfigError(
                f"task {self.name!r}: a sandbox task runs a plain function's source in the sandbox, "
                "where the task object does not exist; drop bind=True (and do not subclass run())"
            )
        return run

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the function as one job in a fresh sandbox and return its JSON result."""
        started = time.monotonic()
        check_serializer("serializer", self.serializer)
        check_serializer("result_serializer", self.app.conf.result_serializer)
        request = self.request
        spec, limit = self.job_spec(args, kwargs, request, elapsed=time.monotonic() - started)
        # Counted before anything can kill this process, so a try that never finishes still counts.
        deliveries = self.count_delivery(request) if spec.key is not None else None
        client = self.sandbox_client()
        try:
            if spec.key is not None:
                redelivered = bool((request.delivery_info or {}).get("redelivered"))
                match = redelivered_attempts(spec.key) if redelivered else earlier_attempts(spec.key)
                reap_best_effort(client, match, "sandboxes of earlier deliveries")
            if deliveries is not None and self.max_deliveries and deliveries > self.max_deliveries:
                raise SandboxJobFailed.over_max_deliveries(deliveries, self.max_deliveries)
            # revoke(terminate=True) and a cancel on connection loss SIGTERM the pool process,
            # whose handler (billiard's) raises SystemExit here: run_job deletes the sandbox
            # on its way out, before the process exits.
            outcome = run_job(client, spec, reap=False)
        finally:
            close = getattr(client, "close", None)
            if callable(close):
                close()
        return self.settle(outcome, limit)

    def count_delivery(self, request: Any) -> Optional[int]:
        """This delivery's number within its try (1 on the first), counted in the result backend
        by the worker (the producer writes nothing of it); None when there is no cap or the
        backend cannot count."""
        if not self.max_deliveries:
            return None
        backend = self.backend
        key = f"pandastack-celery-deliveries-{request.id}-{int(getattr(request, 'retries', 0) or 0)}"
        try:
            if not callable(getattr(backend, "incr", None)):  # rpc://, a database: no counters
                raise NotImplementedError(type(backend).__name__)
            try:
                n = backend.incr(key)
            except KeyError:  # a memory cache: no such key yet
                n = None
            if n is None:  # memcached's incr of a missing key
                backend.set(key, "1")
                n = 1
            backend.expire(key, max(DELIVERY_COUNT_SECONDS, _seconds(self.app.conf.result_expires)))
        except NotImplementedError:
            if not _UNCOUNTED:
                _UNCOUNTED.add(type(backend).__name__)
                logger.warning(
                    "result backend %s cannot count deliveries: sandbox tasks have no max_deliveries "
                    "cap (a task whose worker dies every time is redelivered forever); use a Redis or "
                    "memcached result backend",
                    type(backend).__name__,
                )
            return None
        return int(n)

    def sandbox_client(self) -> Any:
        """A PandaStack client for one call (``connection``, else the SDK's environment)."""
        return (self.connection or ConnectionConfig()).client()

    def job_spec(
        self, args: Any, kwargs: Any, request: Any, elapsed: float = 0.0
    ) -> tuple[JobSpec, Optional[float]]:
        """The job of this call, and the Celery time limit that set its clock (None: its own)."""
        job = function_job(self.function(), tuple(args), dict(kwargs))
        options = coerce_options(dict(self.job_options))
        hard, soft = getattr(request, "timelimit", None) or (None, None)
        clock, limit = guest_clock(
            float(options.get("timeout", JobSpec.__dataclass_fields__["timeout"].default)),
            soft or self.soft_time_limit or self.app.conf.task_soft_time_limit,
            hard or self.time_limit or self.app.conf.task_time_limit,
            elapsed,
        )
        options["timeout"] = clock
        key = None
        task_id = getattr(request, "id", None)
        if task_id and not getattr(request, "called_directly", True):
            retries = int(getattr(request, "retries", 0) or 0)
            key = JobKey(
                engine=Engine.CELERY,
                workflow=self.app.main or "celery",
                task=self.name,
                run=str(task_id),
                try_number=retries + 1,
            )
            options["metadata"] = {
                **dict(options.get("metadata") or {}),
                "celery_task": self.name[:256],
                "celery_task_id": str(task_id)[:256],
            }
            options["env"] = {
                **dict(options.get("env") or {}),
                "CELERY_TASK_ID": str(task_id),
                "CELERY_RETRIES": str(retries),
            }
        return JobSpec(key=key, **job, **options), limit

    def settle(self, outcome: JobOutcome, limit: Optional[float] = None) -> Any:
        """The outcome, the Celery way: the result, ``self.retry``, or a failure at once."""
        logger.info("sandbox job of %s[%s]: %s", self.name, self.request.id, outcome.summary())
        if outcome.ok:
            return outcome.result
        if limit is not None and outcome.kind is FailureKind.TIMEOUT:
            raise SandboxJobFailed.from_outcome(
                outcome,
                f"the job ran into the task's time limit ({limit:g}s; its guest clock stops it "
                f"{clock_margin(limit):g}s before Celery's): not retried, as Celery does not retry a "
                "task that ran out of time",
            )
        error = SandboxJobFailed.from_outcome(outcome)
        if outcome.redeliver and not self.request.called_directly:
            countdown = max(float(self.default_retry_delay or 0), outcome.retry_after or 0.0)
            raise self.retry(exc=error, countdown=countdown)
        raise error


_UNCOUNTED: set[str] = set()  # backends already warned about


def _seconds(value: Any) -> int:
    """``result_expires`` (a timedelta, seconds, or None) in whole seconds."""
    if value is None:
        return 0
    total = getattr(value, "total_seconds", None)
    return int(total() if callable(total) else float(value))


def _static_run(cls: type) -> Optional[Callable[..., Any]]:
    """The function of a task class made from a plain function (Celery stores it as a
    staticmethod ``run``), else None."""
    for klass in cls.__mro__:
        if "run" in klass.__dict__:
            run = klass.__dict__["run"]
            return run.__func__ if isinstance(run, staticmethod) else None  # type: ignore[no-any-return]
    return None


def split_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(job options, Celery task options)`` of one set of keyword arguments."""
    names = set(option_names())
    return (
        {k: v for k, v in options.items() if k in names},
        {k: v for k, v in options.items() if k not in names},
    )


@overload
def sandbox_task(app: Celery, fn: F) -> Any: ...


@overload
def sandbox_task(
    app: Celery, fn: None = None, *, connection: Optional[ConnectionConfig] = None, **options: Any
) -> Callable[[F], Any]: ...


def sandbox_task(
    app: Celery,
    fn: Optional[F] = None,
    *,
    connection: Optional[ConnectionConfig] = None,
    **options: Any,
) -> Union[Any, Callable[[F], Any]]:
    """``@sandbox_task(app, timeout=60, max_retries=5)``: register a :class:`SandboxTask`.

    ``options`` are the job's options (``template``, ``timeout``, ``env``, ...: the core's names)
    and Celery's task options (``name``, ``max_retries``, ``default_retry_delay``, ``queue``,
    ``soft_time_limit``, ...), told apart by name. Bad job options fail here, naming the option.
    """
    job_options, celery_options = split_options(options)
    for name in ("bind", "base", "serializer"):
        if name == "serializer" and name in celery_options:
            check_serializer("serializer", celery_options[name])
        elif name in celery_options:
            raise SandboxTaskConfigError(
                f"sandbox_task({name}=...): a sandbox task is always base=SandboxTask and never bound; "
                f"drop {name}"
            )
    validate_options(job_options)
    decorate = app.task(
        base=SandboxTask, job_options=coerce_options(job_options), connection=connection, **celery_options
    )
    if fn is not None:
        return decorate(fn)
    return decorate  # type: ignore[no-any-return]
