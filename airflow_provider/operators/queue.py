"""Consume a batch from a real broker in an Airflow task: one sandbox per message, each message
acked only after its job's result is out.

Airflow's event-driven scheduling (``AssetWatcher`` + ``MessageQueueTrigger``)
acknowledges a message when the trigger fires, before the run and whatever its
outcome. This operator keeps the broker in charge instead: each message stays
leased (its lease extended while its job runs) until the result reached the
reply destination; a redeliverable failure is released back to the broker, a
dead-letter one goes to the broker's dead-letter destination with the reason.
The task's result is the batch's counters. docs/queues.md ("Airflow").
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from pandastack_jobs.queue import (
    CONSUMER_DEFAULTS,
    BrokerUnavailable,
    Consumer,
    batch_done,
    open_transport,
)
from pandastack_jobs.queue.consumer import check_chunking

from ..hooks.pandastack import PandaStackHook

if TYPE_CHECKING:
    from airflow.sdk import Context


class PandaStackQueueOperator(BaseOperator):
    """Run up to ``max_messages`` messages from ``broker`` (a URL as in docs/queues.md), at most
    ``concurrency`` at a time, stopping early once the queue is idle for ``idle_seconds``.

    A broker that cannot be reached fails the task (Airflow's retries apply); message failures
    never fail it: they are the broker's to redeliver or dead-letter. ``fail_on_dead_letter``
    makes a batch with dead letters fail the task, for alerting. ``chunk_size`` > 1 runs up to
    that many messages of one ``chunk_key`` (``tenant`` or ``input.<name>``) one after another in
    one sandbox, each acked on its own (docs/queues.md, "Chunks"); bad chunk settings fail the
    DAG's parse. The consumer's settings and their defaults are the core's
    (:class:`pandastack_jobs.queue.ConsumerSettings`).
    """

    template_fields: Sequence[str] = ("broker", "defaults")
    ui_color = "#e8f4ff"

    # Each consumer setting is its own keyword, as in prefect_blocks/queue.py's consume_queue: the
    # engines need the names spelled out (Airflow renders and validates an operator's keywords in
    # its UI and templating, Prefect builds a flow's parameter schema from its signature), so a
    # **settings pass-through would hide them; the defaults all come from CONSUMER_DEFAULTS.
    def __init__(
        self,
        *,
        broker: str,
        pandastack_conn_id: str = PandaStackHook.default_conn_name,
        concurrency: int = CONSUMER_DEFAULTS.concurrency,
        max_messages: int = CONSUMER_DEFAULTS.max_messages,
        idle_seconds: float = CONSUMER_DEFAULTS.idle_seconds,
        lease_seconds: float = CONSUMER_DEFAULTS.lease_seconds,
        max_deliveries: int = CONSUMER_DEFAULTS.max_deliveries,
        release_delay: float = CONSUMER_DEFAULTS.release_delay,
        drain_seconds: float = CONSUMER_DEFAULTS.batch_drain_seconds,
        chunk_size: int = CONSUMER_DEFAULTS.chunk_size,
        chunk_key: str = CONSUMER_DEFAULTS.chunk_key,
        chunk_keyless: bool = CONSUMER_DEFAULTS.chunk_keyless,
        defaults: Mapping[str, Any] | None = None,
        allowed_templates: Collection[str] | None = None,
        fail_on_dead_letter: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_chunking(chunk_size, chunk_key, max_deliveries)
        self.broker = broker
        self.pandastack_conn_id = pandastack_conn_id
        self.concurrency = concurrency
        self.max_messages = max_messages
        self.idle_seconds = idle_seconds
        self.lease_seconds = lease_seconds
        self.max_deliveries = max_deliveries
        self.release_delay = release_delay
        self.drain_seconds = drain_seconds
        self.chunk_size = chunk_size
        self.chunk_key = chunk_key
        self.chunk_keyless = chunk_keyless
        self.defaults = dict(defaults or {})
        self.allowed_templates = allowed_templates
        self.fail_on_dead_letter = fail_on_dead_letter
        self._consumer: Consumer | None = None

    def execute(self, context: Context) -> dict[str, int]:
        config = PandaStackHook(self.pandastack_conn_id).config
        self._consumer = Consumer(
            open_transport(self.broker, self.lease_seconds),
            config,
            concurrency=self.concurrency,
            max_deliveries=self.max_deliveries,
            defaults=self.defaults,
            release_delay=self.release_delay,
            drain_seconds=self.drain_seconds,
            allowed_templates=self.allowed_templates,
            chunk_size=self.chunk_size,
            chunk_key=self.chunk_key,
            chunk_keyless=self.chunk_keyless,
        )
        try:
            stats = self._consumer.run(batch_done(self.max_messages, self.idle_seconds))
        except BrokerUnavailable as exc:
            raise RuntimeError(f"cannot reach the broker: {exc}") from None
        summary = stats.as_dict()
        self.log.info("queue batch: %s", stats.line())
        if self.fail_on_dead_letter and stats.dead_lettered:
            from airflow.sdk.exceptions import AirflowFailException

            raise AirflowFailException(f"{stats.dead_lettered} message(s) dead-lettered: {summary}")
        return summary

    def on_kill(self) -> None:
        """The task is being stopped: stop pulling and release what has not finished."""
        if self._consumer is not None:
            self._consumer.drain_seconds = 0
            self._consumer.stop()
