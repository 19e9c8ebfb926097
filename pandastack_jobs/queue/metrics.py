"""The queue consumer's Prometheus metrics (``pandastack-jobs consume --metrics-port``) and the
hooks it calls (docs/observability.md lists every metric).

The consumer calls an :class:`Observer` at the few points that matter (received, settled, acked,
dead-lettered, a chunk started, a broker error, each turn of its loop); the default one does
nothing, so a consumer without metrics pays a method call. :class:`ConsumerMetrics` turns them
into counters and histograms in a registry of its own; the counts the consumer keeps anyway
(:class:`~pandastack_jobs.queue.consumer.Stats`) are read at scrape time. Label values are fixed
sets (a failure kind outside the known ones is ``other``): no message id, tenant or command is ever
a label, so the number of series does not grow with the traffic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..outcome import FailureKind
from ..tracing import outcome_class

if TYPE_CHECKING:
    from ..outcome import JobOutcome
    from .transport import Delivery, Transport

logger = logging.getLogger(__name__)

# The consumer (.consumer.Consumer) imports this module for its observer, so it is typed by what is
# read of it here, not imported (the packages import no circle).
Consumer = Any

# Dead-letter kinds: the failure kinds, plus the two the consumer decides before a job runs.
DEAD_KINDS = frozenset({*(k.value for k in FailureKind), "malformed", "max_deliveries", "unknown"})
OUTCOMES = ("ok", "redeliver", "dead_letter")
BACKLOG_STATES = ("ready", "delayed", "leased")
BACKLOG_EVERY_SECONDS = 5.0
# A producer-written send time further from now than this is not believed (a clock or a forgery).
MAX_LATENCY_SECONDS = 30 * 24 * 3600.0
# The consumer's histograms: name -> (help, buckets). Declared in one table and made by one
# helper (ConsumerMetrics.__init__), each in the consumer's own registry.
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "pandastack_queue_message_deliveries": (
        "The delivery count of each message received (1: its first delivery).",
        (1, 2, 3, 5, 10, 20),
    ),
    "pandastack_queue_job_duration_seconds": (
        "One job's run (create to delete), by outcome class.",
        (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
    ),
    "pandastack_queue_end_to_end_seconds": (
        "From the message's first enqueue to its ack (where the broker tells the enqueue time).",
        (0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
    ),
    "pandastack_queue_chunk_size": (
        "Messages run in one sandbox (1 unless --chunk-size > 1).",
        (1, 2, 4, 8, 16, 32),
    ),
}
SYSTEMS = {
    "RedisStreamsTransport": "redis",
    "PostgresTransport": "postgresql",
    "RabbitMQTransport": "rabbitmq",
    "SQSTransport": "aws_sqs",
}


def messaging_system(transport: Transport) -> str:
    """The OpenTelemetry ``messaging.system`` of ``transport`` (its own ``messaging_system`` wins)."""
    own = getattr(transport, "messaging_system", None)
    if isinstance(own, str) and own:
        return own
    name = type(transport).__name__
    return SYSTEMS.get(name, name.removesuffix("Transport").lower() or "other")


def sent_at(delivery: Delivery) -> float | None:
    """When the message was first enqueued (epoch seconds) as the transport read it
    (``extra["sent"]``: seconds, or milliseconds as Redis ids and SQS give them), or None."""
    raw = delivery.extra.get("sent") if isinstance(delivery.extra, dict) else None
    if isinstance(raw, bytes):
        raw = raw.decode("ascii", "replace")
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if value > 1e11:  # milliseconds
        value /= 1000.0
    if not abs(time.time() - value) <= MAX_LATENCY_SECONDS:  # NaN, inf, a far clock
        return None
    return value


class Observer:
    """What the consumer tells its metrics; this one does nothing (no ``--metrics-port``)."""

    def received(self, delivery: Delivery) -> None:
        """A delivery came in (before it is parsed)."""

    def settled(self, delivery: Delivery, outcome: JobOutcome) -> None:
        """A job ended and is being settled."""

    def acked(self, delivery: Delivery) -> None:
        """A message was acked (its result is out)."""

    def dead_lettered(self, delivery: Delivery, kind: str) -> None:
        """A message went to the dead-letter destination."""

    def chunk(self, size: int) -> None:
        """A sandbox was started for ``size`` messages (1: a lone message)."""

    def broker_error(self) -> None:
        """A transport call found the broker unavailable."""

    def tick(self, consumer: Consumer) -> None:
        """A turn of the consumer's loop, on the thread that owns the transport."""


class ConsumerMetrics(Observer):
    """The consumer's metrics in a registry of its own; :meth:`serve` exposes them over HTTP."""

    def __init__(self, consumer: Consumer, backlog_every: float = BACKLOG_EVERY_SECONDS) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.consumer = consumer
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry

        def histogram(name: str, *labels: str) -> Histogram:
            doc, buckets = HISTOGRAMS[name]
            return Histogram(name, doc, labels, buckets=buckets, registry=reg)

        self.deliveries = histogram("pandastack_queue_message_deliveries")
        self.dead = Counter(
            "pandastack_queue_messages_dead_lettered",
            "Messages dead-lettered, by the kind of failure.",
            ["kind"],
            registry=reg,
        )
        for kind in ("malformed", "max_deliveries"):
            self.dead.labels(kind)
        self.duration = histogram("pandastack_queue_job_duration_seconds", "outcome")
        for outcome in OUTCOMES:
            self.duration.labels(outcome)
        self.latency = histogram("pandastack_queue_end_to_end_seconds")
        self.chunks = histogram("pandastack_queue_chunk_size")
        self.errors = Counter(
            "pandastack_queue_broker_errors",
            "Transport calls that found the broker unavailable.",
            registry=reg,
        )
        self.backlog_every = backlog_every
        self._backlog: dict[str, int] | None = None
        self._backlog_at = float("-inf")
        reg.register(_StatsCollector(self))
        self._server: Any = None

    # -- the hooks -------------------------------------------------------------------------------

    def received(self, delivery: Delivery) -> None:
        self.deliveries.observe(max(int(delivery.count), 1))

    def settled(self, delivery: Delivery, outcome: JobOutcome) -> None:
        self.duration.labels(outcome_class(outcome)).observe(max(outcome.timings.total, 0.0))

    def acked(self, delivery: Delivery) -> None:
        sent = sent_at(delivery)
        if sent is not None:
            self.latency.observe(max(time.time() - sent, 0.0))

    def dead_lettered(self, delivery: Delivery, kind: str) -> None:
        self.dead.labels(kind if kind in DEAD_KINDS else "other").inc()

    def chunk(self, size: int) -> None:
        self.chunks.observe(size)

    def broker_error(self) -> None:
        self.errors.inc()

    def tick(self, consumer: Consumer) -> None:
        """Read the broker's backlog every ``backlog_every`` seconds (the transport is this
        thread's: a scrape never touches it)."""
        now = time.monotonic()
        if now - self._backlog_at < self.backlog_every:
            return
        self._backlog_at = now
        try:
            got = consumer.transport.backlog()
        except Exception as exc:  # noqa: BLE001 - a metric must never stop the loop
            logger.debug("backlog not read: %s", exc)
            return
        self._backlog = None if got is None else {k: int(v) for k, v in got.items() if k in BACKLOG_STATES}

    # -- serving ---------------------------------------------------------------------------------

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` (0: a free port) in a daemon thread; returns the port."""
        from prometheus_client import start_http_server

        server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = (server, thread)
        return int(server.server_address[1])

    def close(self) -> None:
        if self._server is not None:
            server, thread = self._server
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
            self._server = None


class _StatsCollector:
    """The counts the consumer keeps anyway, read at scrape time (no hook needed for them)."""

    def __init__(self, metrics: ConsumerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.metrics.consumer.stats
        for name, doc, value in (
            ("pandastack_queue_messages_received", "Deliveries received.", s.received),
            ("pandastack_queue_messages_acked", "Messages acked after their result was out.", s.acked),
            (
                "pandastack_queue_broker_reconnects",
                "Reconnects after the broker was unavailable.",
                s.reconnects,
            ),
            (
                "pandastack_queue_leases_lost",
                "Deliveries whose lease was lost before settling.",
                s.leases_lost,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        released = CounterMetricFamily(
            "pandastack_queue_messages_released",
            "Messages given back for another delivery: after a redeliverable failure, or on a drain.",
            labels=["reason"],
        )
        released.add_metric(["redeliver"], s.redelivered)
        released.add_metric(["drain"], s.released_on_drain)
        yield released
        yield GaugeMetricFamily("pandastack_queue_jobs_in_flight", "Jobs running now.", value=s.in_flight)
        yield GaugeMetricFamily(
            "pandastack_queue_sandboxes_in_use",
            "Sandboxes (lone messages or chunks) in use now.",
            value=s.sandboxes,
        )
        yield GaugeMetricFamily(
            "pandastack_queue_concurrency",
            "The consumer's --concurrency.",
            value=self.metrics.consumer.concurrency,
        )
        yield GaugeMetricFamily(
            "pandastack_queue_last_activity_timestamp_seconds",
            "When a message was last received or settled (epoch seconds).",
            value=time.time() - (time.monotonic() - s.last_activity),
        )
        backlog = self.metrics._backlog
        if backlog is not None:
            family = GaugeMetricFamily(
                "pandastack_queue_backlog_messages",
                "Messages on the broker, by state, as the broker tells it (read every few seconds).",
                labels=["state"],
            )
            for state in BACKLOG_STATES:
                if state in backlog:
                    family.add_metric([state], backlog[state])
            yield family
