"""A Prefect flow that consumes a real broker: each message one sandbox job, run as a task run of
the flow, acked only after that task run completed with the job's result out.

Prefect has no queue trigger outside its own events; this flow is the
consumer. Each message's job is a task run (``queue-message``, no retries, no
cache: the broker redelivers), so the Prefect UI shows every message with its
state; the consumer's concurrency cap bounds the live sandboxes. A failed task
run's message is released to the broker for redelivery, or dead-lettered with
the reason (docs/queues.md, "Prefect").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pandastack_jobs import JobOutcome, JobSpec
from pandastack_jobs.queue import CONSUMER_DEFAULTS, Consumer, QueueJob, batch_done, open_transport

from .credentials import PandaStackCredentials
from .exceptions import PandaStackPrefectError


class QueueMessageFailed(PandaStackPrefectError, RuntimeError):
    """A message's job failed: its task run fails with the reason, the broker decides the rest."""

    def __init__(self, outcome: JobOutcome) -> None:
        super().__init__(
            f"{outcome.failure_class.value if outcome.failure_class else 'failed'}: {outcome.reason}"
        )
        self.outcome = outcome


@task(
    name="queue-message", retries=0, cache_policy=NO_CACHE, task_run_name="message {message_id} #{delivery}"
)
def queue_message(message_id: str, delivery: int, run: Callable[[], JobOutcome]) -> dict[str, Any]:
    """One message's sandbox job; its summary is the task's result."""
    outcome = run()
    if not outcome.ok:
        raise QueueMessageFailed(outcome)
    return outcome.summary()


def task_runner(job: QueueJob, spec: JobSpec, run: Callable[[], JobOutcome]) -> JobOutcome:
    """The consumer's runner: the job as a ``queue-message`` task run; the outcome either way."""
    seen: list[JobOutcome] = []

    def tracked() -> JobOutcome:
        seen.append(run())
        return seen[-1]

    try:
        queue_message(job.message_id, spec.key.try_number if spec.key else 1, tracked)
    except QueueMessageFailed:
        pass
    except Exception:
        if not seen:  # Prefect could not run the task at all: the consumer redelivers
            raise
    return seen[-1]


# The settings are spelled out one by one, as in airflow_provider/operators/queue.py's operator:
# Prefect builds the deployment's parameter schema (and its UI form) from this signature, so a
# **settings pass-through would hide them; the defaults all come from CONSUMER_DEFAULTS.
@flow(name="pandastack-queue-consumer", log_prints=True)
def consume_queue(
    broker: str,
    credentials: Optional[PandaStackCredentials] = None,
    concurrency: int = CONSUMER_DEFAULTS.concurrency,
    max_messages: int = CONSUMER_DEFAULTS.max_messages,
    idle_seconds: float = CONSUMER_DEFAULTS.idle_seconds,
    lease_seconds: float = CONSUMER_DEFAULTS.lease_seconds,
    max_deliveries: int = CONSUMER_DEFAULTS.max_deliveries,
    release_delay: float = CONSUMER_DEFAULTS.release_delay,
    defaults: Optional[dict[str, Any]] = None,
    allowed_templates: Optional[list[str]] = None,
    chunk_size: int = CONSUMER_DEFAULTS.chunk_size,
    chunk_key: str = CONSUMER_DEFAULTS.chunk_key,
    chunk_keyless: bool = CONSUMER_DEFAULTS.chunk_keyless,
) -> dict[str, int]:
    """Consume up to ``max_messages`` from ``broker`` (stopping once idle ``idle_seconds``); return the
    batch's counters. An unreachable broker fails the flow run. ``chunk_size`` > 1 runs up to that
    many messages of one ``chunk_key`` in one sandbox; each is still its own task run, acked after
    it completed (docs/queues.md, "Chunks"). The consumer's settings and their defaults are the
    core's (:class:`pandastack_jobs.queue.ConsumerSettings`)."""
    consumer = Consumer(
        open_transport(broker, lease_seconds),
        (credentials or PandaStackCredentials()).connection_config(),
        concurrency=concurrency,
        max_deliveries=max_deliveries,
        defaults=defaults,
        release_delay=release_delay,
        drain_seconds=CONSUMER_DEFAULTS.batch_drain_seconds,
        allowed_templates=allowed_templates,
        runner=task_runner,
        chunk_size=chunk_size,
        chunk_key=chunk_key,
        chunk_keyless=chunk_keyless,
    )
    stats = consumer.run(batch_done(max_messages, idle_seconds))
    get_run_logger().info("queue batch: %s", stats.line())
    return stats.as_dict()
