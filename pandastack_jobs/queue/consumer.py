"""The queue consumer: one ``run_job`` per message, acked only after its result is out.

One thread (the loop) owns the transport: it receives, extends leases, and
settles each finished job (result to the sink, then ack; or release for
redelivery; or dead-letter). Jobs run on a pool of ``concurrency`` threads that
talk only to PandaStack, so a broker outage never stops a running job: the loop
reconnects and settles what finished meanwhile. An outage of PandaStack itself is
not charged to the messages either: the loop gives back what it pulled, pauses
pulling and probes the API until it answers (``outage.py``).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import json
import logging
import queue as queue_mod
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from .. import tracing
from ..connection import ConnectionConfig
from ..lifecycle import JobHandle, run_job
from ..outcome import FailureKind, JobOutcome
from ..spec import JobSpec
from .chunks import check_key, group_of, plan, reap_chunks_before, run_chunk
from .message import DEFAULT_MAX_MESSAGE_BYTES, MAX_JSON_DEPTH, MessageError, QueueJob, parse
from .metrics import Observer, messaging_system
from .outage import ApiKeyRejected, Backoff, Uncharged, maybe_platform, platform_failure, probe
from .transport import (
    BrokerUnavailable,
    DeadLetter,
    Delivery,
    LeaseLost,
    RecordRejected,
    Transport,
    correlation_id,
)

logger = logging.getLogger(__name__)

MAX_UNCHARGED = 10
"""A message's deliveries spoiled by the platform that are not counted; later ones count."""

Sink = Callable[[QueueJob, Delivery, JobOutcome], None]
"""Takes a successful job's result out (raise to leave the message for redelivery)."""
Runner = Callable[[QueueJob, JobSpec, Callable[[], JobOutcome]], JobOutcome]
"""Wraps the run of one message's job (``run()`` is the :func:`run_job` call), e.g. as an engine's
task run; it returns the outcome ``run()`` returned."""


@dataclass(frozen=True)
class ConsumerSettings:
    """The consumer's settings an adapter offers, with their defaults, declared once here: the
    Airflow ``PandaStackQueueOperator`` and Prefect's ``consume_queue`` take their defaults from
    :data:`CONSUMER_DEFAULTS` instead of repeating them."""

    concurrency: int = 4
    """Jobs running at once."""
    max_deliveries: int = 5
    """A message delivered this many times without success is dead-lettered."""
    release_delay: float = 1.0
    """The least delay before a redelivery, seconds."""
    drain_seconds: float = 30.0
    """How long a stop waits for running jobs before cancelling them."""
    batch_drain_seconds: float = 3600.0
    """The same for an engine's batch task: its jobs are let finish (the task's own timeout rules)."""
    lease_seconds: float = 60.0
    """The broker's visibility/claim timeout (:func:`~pandastack_jobs.queue.open_transport`)."""
    max_messages: int = 100
    """A batch (:func:`batch_done`) stops pulling after this many messages..."""
    idle_seconds: float = 5.0
    """...or once nothing ran and nothing came for this long."""
    chunk_size: int = 1
    """Up to this many messages of one isolation key run one after another in one sandbox."""
    chunk_key: str = "tenant"
    """The isolation key of a chunk: ``tenant`` (the message's field) or ``input.<name>``."""
    chunk_keyless: bool = False
    """Messages without the key may share sandboxes with each other (else each runs alone)."""


CONSUMER_DEFAULTS = ConsumerSettings()


@dataclass
class Stats:
    """Counters for the progress line and the tests."""

    started: float = field(default_factory=time.monotonic)
    received: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0
    sandboxes: int = 0
    """Slots in use: one sandbox each (a lone message or a chunk)."""
    peak_sandboxes: int = 0
    chunks: int = 0
    """Chunks of two or more messages started (``chunk_size`` > 1)."""
    acked: int = 0
    redelivered: int = 0
    dead_lettered: int = 0
    released_on_drain: int = 0
    reconnects: int = 0
    leases_lost: int = 0
    last_activity: float = field(default_factory=time.monotonic)
    """When a message was last received or settled (for :func:`batch_done`)."""
    api_down_since: float | None = None
    """Wall-clock time (epoch seconds) since when PandaStack is unreachable and pulling is paused."""
    api_down_reason: str = ""
    api_down_what: str = "unreachable"
    uncharged: int = 0
    """Deliveries given back without being counted: the platform, not the message, failed (those
    of jobs that ran are in ``redelivered`` too)."""

    def rate(self) -> float:
        """Acked messages per second since the start."""
        return self.acked / max(time.monotonic() - self.started, 1e-9)

    def as_dict(self) -> dict[str, int]:
        """The counters, JSON-safe (an engine's task result)."""
        names = ("received", "acked", "redelivered", "dead_lettered", "released_on_drain", "reconnects")
        return {name: getattr(self, name) for name in (*names, "leases_lost")}

    def line(self) -> str:
        text = (
            f"in flight {self.in_flight}  acked {self.acked}  redelivered {self.redelivered}  "
            f"dead-lettered {self.dead_lettered}  {self.rate():.2f} msg/s"
        )
        down = self.api_down_since
        if down is not None:
            text += f"  PandaStack {self.api_down_what} since {_clock(down)}, pulling paused"
        return text


def _clock(epoch: float) -> str:
    """``2026-12-05 18:40:10Z``: a wall-clock time for logs and the progress line."""
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def check_chunking(chunk_size: int, chunk_key: str, max_deliveries: int) -> None:
    """Raise ``ValueError`` naming the setting if the chunk settings cannot work (an adapter calls
    this where its user declares them, e.g. when a DAG is parsed)."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int of at least 1, not {chunk_size!r}")
    if chunk_size > 1 and max_deliveries < 2:
        # A chunk's death releases its unfinished mates for another delivery (alone).
        raise ValueError("chunk_size > 1 needs max_deliveries >= 2")
    check_key(chunk_key)


def batch_done(max_messages: int, idle_seconds: float) -> Callable[[Stats], bool]:
    """A :meth:`Consumer.run` stop condition for a batch (an engine task): stop pulling once
    ``max_messages`` were received, or once nothing ran and nothing came for ``idle_seconds``."""

    def done(stats: Stats) -> bool:
        if stats.received >= max_messages:
            return True
        return stats.in_flight == 0 and time.monotonic() - stats.last_activity >= idle_seconds

    return done


def reply_sink(transport: Transport) -> Sink:
    """The default sink: a JSON reply on the transport's reply destination, carrying the
    producer's correlation ``id``, its ``tenant`` and the broker's id of the message
    (``broker_id``): two messages may share an ``id``, never a ``broker_id``, so a reader drops
    the rare duplicate of a result whose ack was lost by ``broker_id``."""

    def sink(job: QueueJob, delivery: Delivery, outcome: JobOutcome) -> None:
        body = {
            "id": job.message_id,
            "tenant": job.tenant,
            "broker_id": delivery.message_id,
            "ok": True,
            "result": outcome.result,
            "delivery": delivery.count,
            "sandbox_id": outcome.sandbox_id,
            "timings": outcome.timings.as_dict(),
        }
        transport.reply(json.dumps(body).encode())

    return sink


class _NotingHandle(JobHandle):
    """A job's handle that also tells the consumer when its sandbox was created: a create that
    went through, so the platform had room then (see ``Consumer._room_for_others``)."""

    def __init__(self, created: Callable[[], None]) -> None:
        super().__init__()
        self._created = created

    def attach(self, client: Any, sandbox_id: str) -> None:
        self._created()
        super().attach(client, sandbox_id)


@dataclass
class _Work:
    delivery: Delivery
    job: QueueJob
    handle: JobHandle = field(default_factory=JobHandle)
    launched: float = 0.0
    """When its job was handed to the pool (monotonic): its create came after."""
    drained: bool = False
    outcome: JobOutcome | None = None
    replied: bool = False
    slot: int = 0
    chunked: bool = False
    consumer_error: bool = False
    """The outcome is the consumer's own bug, not the platform's answer."""


class Consumer:
    """Consume ``transport`` until :meth:`stop` (or SIGTERM with :meth:`install_signal_handlers`).

    ``defaults``: job options applied under each message's own (e.g. the template).
    ``max_deliveries``: a message delivered this many times without success is dead-lettered.
    ``allowed_templates``: the only templates a message may name (None: any).
    ``runner``: wraps each job's run (an engine's task run); jobs run in the context (contextvars)
    of the thread that called :meth:`run`, so an engine's run context reaches them.
    ``release_delay``: the least delay before a redelivery (capacity refusals wait their
    ``Retry-After`` if longer). ``drain_seconds``: how long a stop waits for running jobs
    before cancelling them and releasing their messages.
    ``chunk_size``: up to this many messages run one after another in one sandbox (docs/queues.md,
    "Chunks"), each with its own result and settlement; only messages with the same isolation key
    (``chunk_key``: ``tenant`` or ``input.<name>``) and the same job options share one, and a
    message without a key runs alone unless ``chunk_keyless``. ``concurrency`` counts sandboxes.
    ``api_backoff``: the waits between probes of an unreachable PandaStack API (default 1 s
    doubling to 15 s, jittered).
    """

    def __init__(
        self,
        transport: Transport,
        connection: ConnectionConfig | None = None,
        *,
        sink: Sink | None = None,
        concurrency: int = CONSUMER_DEFAULTS.concurrency,
        max_deliveries: int = CONSUMER_DEFAULTS.max_deliveries,
        defaults: Mapping[str, Any] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        release_delay: float = CONSUMER_DEFAULTS.release_delay,
        drain_seconds: float = CONSUMER_DEFAULTS.drain_seconds,
        poll_seconds: float = 1.0,
        allowed_templates: Collection[str] | None = None,
        runner: Runner | None = None,
        chunk_size: int = CONSUMER_DEFAULTS.chunk_size,
        chunk_key: str = CONSUMER_DEFAULTS.chunk_key,
        chunk_keyless: bool = CONSUMER_DEFAULTS.chunk_keyless,
        api_backoff: Backoff | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        check_chunking(chunk_size, chunk_key, max_deliveries)
        if max_deliveries < 1:
            raise ValueError("max_deliveries must be at least 1")
        self.transport = transport
        transport.max_body_bytes = max_message_bytes  # bounded before it is read, where it can be
        self.connection = connection or ConnectionConfig()
        self.sink = sink or reply_sink(transport)
        self.concurrency = concurrency
        self.max_deliveries = max_deliveries
        self.defaults = dict(defaults or {})
        self.max_message_bytes = max_message_bytes
        self.release_delay = release_delay
        self.drain_seconds = drain_seconds
        self.poll_seconds = poll_seconds
        self.allowed_templates = frozenset(allowed_templates) if allowed_templates is not None else None
        self.runner = runner
        self.chunk_size = chunk_size
        self.chunk_key = chunk_key
        self.chunk_keyless = chunk_keyless
        self.stats = Stats()
        self.observer = Observer()
        """Told what happens, for metrics (pandastack_jobs/queue/metrics.py); the default does nothing."""
        self.ready = threading.Event()
        """Set once the broker is connected and the loop's first receive returned (a readiness
        probe, or a test that must know two consumers compete before it sends; a Kafka consumer
        has joined its group by then)."""
        self._stop = threading.Event()
        self._stop_at: float | None = None
        self._done: queue_mod.Queue[_Work] = queue_mod.Queue()
        self._settle: deque[_Work] = deque()
        self._running: dict[int, _Work] = {}
        self._pending: list[_Work] = []  # received and parsed, waiting for a free slot
        self._slots: dict[int, int] = {}  # slot -> its messages not yet collected
        self._next_slot = 0
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="pandastack-queue")
        # The platform's outages (outage.py): spoiled deliveries, the probe in flight, its backoff.
        self._uncharged = Uncharged()
        self._backoff = api_backoff or Backoff()
        self._probe: Future[None] | None = None
        self._next_probe = 0.0
        # When a job's create last went through (monotonic; set from the pool's threads), and per
        # message when the platform last refused its create for capacity, and whether others'
        # creates went through beside its refusals (``_room_for_others``).
        self._last_create = float("-inf")
        self._refused_at: dict[str, tuple[float, bool]] = {}

    # -- control ---------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop pulling; running jobs get ``drain_seconds`` to finish (safe from a signal handler)."""
        self._stop.set()
        self.transport.wake()  # a receive under way that waits longer than asked ends sooner

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT drain (call from the main thread)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    # -- the loop --------------------------------------------------------------------------------

    def run(self, until: Callable[[Stats], bool] | None = None) -> Stats:
        """Consume until stopped (or ``until(stats)`` holds), drain, and return the counters."""
        next_extend = time.monotonic()
        try:
            self.transport.connect()  # an unreachable broker at the start is an error, not a wait
            self.stats.last_activity = time.monotonic()  # a batch's idle time starts now, not at the connect
            while True:
                if until is not None and not self._stop.is_set() and until(self.stats):
                    self.stop()
                self._collect()
                self._broker(self.transport.heartbeat)
                self._drop_lost()
                self.observer.tick(self)
                self._settle_finished()
                self._watch_api()
                if self._stop.is_set():
                    if self._stop_at is None:
                        self._stop_at = time.monotonic() + self.drain_seconds
                        logger.warning(
                            "stopping: draining %d job(s) (up to %gs); no more pulls",
                            len(self._running),
                            self.drain_seconds,
                        )
                    self._release_pending()
                    if not self._running and not self._settle and not self._pending:
                        logger.warning("drained: %s", self.stats.line())
                        break
                    if time.monotonic() >= self._stop_at:
                        self._cancel_running()
                if time.monotonic() >= next_extend:
                    self._extend_leases()
                    next_extend = time.monotonic() + self._extend_interval()
                free = self.concurrency - len(self._slots)
                if free > 0 and not self._stop.is_set() and self.stats.api_down_since is None:
                    room = free * self.chunk_size - len(self._pending)
                    if room > 0:
                        wait = 0.0 if self._pending else 0.2 if self._running else self.poll_seconds
                        for delivery in self._receive(room, wait):
                            self._start(delivery)
                        self.ready.set()
                    self._launch(free)
                else:
                    self._wait_done(0.2)
        finally:
            # Leaving with jobs still running (the broker stayed down through a stop): cancel
            # them; their messages were never acked and come back to the next consumer.
            self._cancel_running()
            self._pool.shutdown(wait=True, cancel_futures=True)
            for work in self._pending:  # never run, never acked: give them back if the broker is up
                try:
                    self.transport.release(work.delivery, 0)
                except Exception:  # noqa: BLE001 - they come back anyway when their lease ends
                    break
            self._pending.clear()
            self.transport.close()
        return self.stats

    def _receive(self, room: int, wait: float) -> list[Delivery]:
        """The transport's receive; an error that is not the broker being down (a transport bug
        on some entry) is logged and the loop goes on after a pause, never stopping."""
        try:
            got = self._broker(functools.partial(self.transport.receive, room, wait))
        except BrokerUnavailable:
            raise
        except Exception:  # each transport confines a bad entry; this is the backstop
            logger.exception("receive failed; pulling again in 1 s")
            self._stop.wait(1.0)
            return []
        return list(got or [])

    def _extend_interval(self) -> float:
        lease = self.transport.lease_seconds
        return max(0.5, lease / 3) if lease else 30.0

    def _wait_done(self, timeout: float) -> None:
        try:
            self._done.put(self._done.get(timeout=timeout))
        except queue_mod.Empty:
            pass

    # -- starting a message ----------------------------------------------------------------------

    def _start(self, delivery: Delivery) -> None:
        """Parse and queue one delivery; whatever goes wrong with it stays with it (dead-lettered
        with the reason), never stopping the loop."""
        self.stats.received += 1
        self.stats.last_activity = time.monotonic()
        self.observer.received(delivery)
        try:
            self._start_one(delivery)
        except BrokerUnavailable:
            raise
        except Exception as exc:  # a bug on one message must not stop the consumer
            logger.exception("message %s could not be started; dead-lettering it", delivery.message_id)
            reason = f"consumer error while starting the message: {type(exc).__name__}: {exc}"
            self._dead_at_once(delivery, DeadLetter(reason, "consumer_error", None, delivery.count), None)

    def _start_one(self, delivery: Delivery) -> None:
        if delivery.malformed is not None:  # broker-level fields the transport does not accept
            exc = MessageError(*delivery.malformed)
            self._dead_at_once(delivery, DeadLetter(str(exc), "malformed", exc.field, delivery.count), None)
            return
        try:
            job = parse(
                delivery.body,
                delivery.message_id,
                defaults=self.defaults,
                max_bytes=self.max_message_bytes,
                allowed_templates=self.allowed_templates,
            )
        except MessageError as exc:
            self._dead_at_once(delivery, DeadLetter(str(exc), "malformed", exc.field, delivery.count), None)
            return
        except RecursionError:  # a bound missed (the depth scan should have refused it)
            reason = f"body: nests too deeply to parse (the limit is {MAX_JSON_DEPTH}, MAX_JSON_DEPTH)"
            self._dead_at_once(delivery, DeadLetter(reason, "malformed", "body", delivery.count), None)
            return
        count = self._uncharged.charged(delivery.message_id, delivery.count)
        if count > self.max_deliveries:
            reason = (
                f"delivered {count} times, over max_deliveries={self.max_deliveries}: "
                "earlier deliveries ended without a result (a worker died with it each time)"
            )
            self._dead_at_once(delivery, DeadLetter(reason, "max_deliveries", None, count), job)
            return
        self._pending.append(_Work(delivery, job, handle=_NotingHandle(self._created)))

    def _group(self, work: _Work) -> Any:
        """A message on its second or later delivery runs alone: if it is what killed its
        chunk's sandbox, it does not take chunk-mates down with it again."""
        if self.chunk_size == 1 or work.delivery.count > 1:
            return None
        return group_of(work.job, self.chunk_key, self.chunk_keyless)

    def _launch(self, free: int) -> None:
        """Start up to ``free`` sandboxes on the pending messages (one, or a chunk, each)."""
        if not self._pending:
            return
        for chunk in plan(self._pending, self._group, self.chunk_size, free):
            slot = self._next_slot
            self._next_slot += 1
            self._slots[slot] = len(chunk)
            for work in chunk:
                self._pending.remove(work)
                work.slot, work.chunked = slot, len(chunk) > 1
                work.launched = time.monotonic()
                self._running[id(work)] = work
            self.stats.in_flight = len(self._running)
            self.stats.peak_in_flight = max(self.stats.peak_in_flight, self.stats.in_flight)
            self.stats.sandboxes = len(self._slots)
            self.stats.peak_sandboxes = max(self.stats.peak_sandboxes, self.stats.sandboxes)
            self.observer.chunk(len(chunk))
            if len(chunk) == 1:
                self._pool.submit(contextvars.copy_context().run, self._run_one, chunk[0])
            else:
                self.stats.chunks += 1
                self._pool.submit(contextvars.copy_context().run, self._run_chunk, chunk)

    def _release_pending(self, uncharged: bool = False) -> None:
        """Give back what was pulled and not started (a drain, an outage). Like a settle, one
        message's give-back never stops the loop: a broker outage keeps the rest for the next
        call, a record the broker refuses for itself is dead-lettered (``release_rejected``), a
        lost lease or any other error leaves the message to the broker (it comes back)."""
        while self._pending:
            work = self._pending[0]
            d = work.delivery
            try:
                if self._broker(functools.partial(self.transport.release, d, 0), failed=False) is False:
                    return  # the broker is down: give them back after the reconnect
            except RecordRejected as exc:
                self._pending.pop(0)
                reason = f"the broker refused the record that gives it back: {exc}"
                self._dead_at_once(d, DeadLetter(reason, "release_rejected", None, d.count), work.job)
                continue
            except BrokerUnavailable:
                raise
            except Exception as exc:  # noqa: BLE001 - LeaseLost, or a transport bug on this one message
                self._pending.pop(0)
                logger.warning("message %s: not given back (%s); left to the broker", d.message_id, exc)
                continue
            self._pending.pop(0)
            if uncharged:
                self._uncharged.add(work.delivery.message_id)
                self.stats.uncharged += 1
            else:
                self.stats.released_on_drain += 1

    def _run_chunk(self, works: list[_Work]) -> None:
        """One sandbox for ``works`` (see :func:`~pandastack_jobs.queue.chunks.run_chunk`); each
        mate is handed to the loop as it ends, the last after the sandbox is deleted."""
        handed: set[int] = set()

        def finished(i: int, outcome: JobOutcome) -> None:
            works[i].outcome = outcome
            handed.add(i)
            self._done.put(works[i])

        client = None
        try:
            specs = [
                w.job.spec(self.transport.name, w.delivery.count, self.transport.key_scope) for w in works
            ]

            def wrap(i: int, run: Callable[[], JobOutcome]) -> JobOutcome:
                with self._process_span(works[i]):
                    return self.runner(works[i].job, specs[i], run) if self.runner is not None else run()

            client = self.connection.client()
            run_chunk(client, specs, handles=[w.handle for w in works], wrap=wrap, on_finished=finished)
        except Exception as exc:  # a bug here must not lose the messages
            logger.exception("chunk of %d message(s) raised", len(works))
            for i, work in enumerate(works):
                if i not in handed:
                    work.consumer_error = True
                    work.outcome = JobOutcome(
                        ok=False, kind=FailureKind.SERVER_ERROR, reason=f"consumer error: {exc}"
                    )
        finally:
            close = getattr(client, "close", None)
            if callable(close):
                close()
            for i, work in enumerate(works):
                if i not in handed:
                    if work.outcome is None:
                        work.outcome = JobOutcome(
                            ok=False, kind=FailureKind.SERVER_ERROR, reason="consumer error: mate not run"
                        )
                    self._done.put(work)

    def _run_one(self, work: _Work) -> None:
        try:
            spec = work.job.spec(self.transport.name, work.delivery.count, self.transport.key_scope)

            def run() -> JobOutcome:
                client = self.connection.client()
                try:
                    # A redelivery runs alone; if its earlier delivery ran in a chunk whose worker
                    # died, that chunk's sandbox carries this message's key as a mate: reap it.
                    reap_chunks_before(client, spec)
                    return run_job(client, spec, handle=work.handle)
                finally:
                    close = getattr(client, "close", None)
                    if callable(close):
                        close()

            with self._process_span(work):
                work.outcome = self.runner(work.job, spec, run) if self.runner is not None else run()
        except Exception as exc:  # a bug here must not lose the message
            logger.exception("job of message %s raised", work.job.message_id)
            work.outcome = JobOutcome(
                ok=False, kind=FailureKind.SERVER_ERROR, reason=f"consumer error: {exc}"
            )
            work.consumer_error = True
        self._done.put(work)

    def _process_span(self, work: _Work) -> Any:
        """The OpenTelemetry ``process`` span of one message (pandastack_jobs/tracing.py)."""
        d = work.delivery
        system, tp = messaging_system(self.transport), d.extra.get("traceparent")
        return tracing.process_span(
            system, self.transport.name, d.message_id, d.count, tp, work.job.message_id
        )

    # -- settling finished jobs ------------------------------------------------------------------

    def _collect(self) -> None:
        while True:
            try:
                work = self._done.get_nowait()
            except queue_mod.Empty:
                return
            self._running.pop(id(work), None)
            self.stats.in_flight = len(self._running)
            left = self._slots.get(work.slot, 1) - 1
            if left > 0:
                self._slots[work.slot] = left
            else:
                self._slots.pop(work.slot, None)
            self.stats.sandboxes = len(self._slots)
            self._settle.append(work)

    def _settle_finished(self) -> None:
        while self._settle:
            work = self._settle[0]
            if self._broker(functools.partial(self._settle_or_lost, work), failed=False) is False:
                return  # the broker is down: keep it, settle after the reconnect
            self._settle.popleft()
            self.stats.last_activity = time.monotonic()

    def _settle_or_lost(self, work: _Work) -> bool:
        try:
            return self._settle_one(work)
        except LeaseLost as exc:
            logger.warning("message %s: lease lost before it was settled (%s)", work.delivery.message_id, exc)
            self.stats.leases_lost += 1
            return True
        except BrokerUnavailable:
            raise
        except Exception:  # one message's settling must not stop the consumer
            # Not acked: the broker hands it out again when its lease ends (its count goes up,
            # so a message that always breaks settling ends as max_deliveries).
            logger.exception("message %s could not be settled; left to the broker", work.delivery.message_id)
            return True

    def _settle_one(self, work: _Work) -> bool:
        """Settle one finished job. A record the broker refuses for itself (a result or a retry
        record over the destination's size limit: :class:`RecordRejected`) is refused again on
        every try: the message is dead-lettered now (kind ``reply_rejected`` or
        ``release_rejected``), never held at the head of the settle queue as an outage."""
        try:
            return self._settle_outcome(work)
        except RecordRejected as exc:  # from a release (the sink's own is handled where it is called)
            d = work.delivery
            reason = f"the broker refused the record that puts it back for a retry: {exc}"
            self._dead(d, DeadLetter(reason, "release_rejected", None, d.count), work.job)
            return True

    def _settle_outcome(self, work: _Work) -> bool:
        d, outcome = work.delivery, work.outcome
        assert outcome is not None
        self.observer.settled(d, outcome)
        if self.transport.lost(d):
            logger.info("message %s: its connection was lost; the broker redelivers it", d.message_id)
            self.stats.redelivered += 1
            return True
        if work.drained or (self._stop.is_set() and outcome.kind is FailureKind.CANCELLED):
            self.transport.release(d, 0)
            self.stats.released_on_drain += 1
            return True
        room = outcome.kind is FailureKind.CAPACITY and self._room_for_others(work)
        if room:
            # Others' creates go through while this one's is refused: the platform is up and has
            # room, just not for this request (a template bigger than what is free). Counted like
            # a job failure, and nobody else's pulling is paused for it.
            logger.warning(
                "message %s: refused for capacity while other creates go through; this delivery counts (%s)",
                d.message_id,
                outcome.reason,
            )
        elif not work.consumer_error and platform_failure(outcome):
            spoiled = self._uncharged.get(d.message_id)
            if spoiled < MAX_UNCHARGED:
                # The platform failed, not the message: give it back uncounted, stop pulling.
                self._uncharged.add(d.message_id)
                self.transport.release(d, max(self.release_delay, outcome.retry_after or 0.0))
                self.stats.redelivered += 1
                self.stats.uncharged += 1
                logger.info("message %s: %s; released, not counted", d.message_id, outcome.reason)
                self._pause(outcome)
                return True
            # So many outages in one message's life is a message the API chokes on (a 5xx at
            # the create for this message alone): from here on its deliveries count.
            logger.warning(
                "message %s: %d deliveries not counted already; this one counts", d.message_id, spoiled
            )
        if not work.consumer_error and maybe_platform(outcome):
            self._check_api()  # a dying server also explains this one: is the API still there?
        if work.chunked and outcome.kind is FailureKind.SANDBOX_LOST:
            # The chunk's sandbox died: no mate is to blame; each comes back and runs alone.
            logger.info("message %s: %s; redelivering", d.message_id, outcome.reason)
            self.transport.release(d, self.release_delay)
            self.stats.redelivered += 1
            return True
        if outcome.ok:
            if not work.replied:
                try:
                    self.sink(work.job, d, outcome)
                except BrokerUnavailable:
                    raise
                except RecordRejected as exc:  # the same result is refused again: never a redelivery
                    reason = (
                        f"the broker refused its result: {exc}; re-running the job would give the same result"
                    )
                    why = DeadLetter(
                        reason, "reply_rejected", None, d.count, outcome.stdout_tail, outcome.stderr_tail
                    )
                    self._dead(d, why, work.job)
                    return True
                except Exception as exc:  # noqa: BLE001 - the result is not out: redeliver
                    logger.warning("message %s: result sink failed (%s); redelivering", d.message_id, exc)
                    self.transport.release(d, self.release_delay)
                    self.stats.redelivered += 1
                    return True
                work.replied = True
            self.transport.ack(d)
            self._uncharged.forget(d.message_id)
            self._refused_at.pop(d.message_id, None)
            self.stats.acked += 1
            self.observer.acked(d)
            return True
        kind = outcome.kind.value if outcome.kind else "unknown"
        count = self._uncharged.charged(d.message_id, d.count)
        if outcome.redeliver and count < self.max_deliveries:
            delay = max(self.release_delay, outcome.retry_after or 0.0)
            logger.info("message %s: %s; redelivering in %.1fs", d.message_id, outcome.reason, delay)
            self.transport.release(d, delay)
            self.stats.redelivered += 1
            return True
        reason = outcome.reason
        if room:
            reason = f"refused for capacity while other messages' creates went through: {reason}"
        if outcome.redeliver:
            reason = f"gave up after {count} deliveries (max_deliveries={self.max_deliveries}): {reason}"
        why = DeadLetter(reason, kind, None, count, outcome.stdout_tail, outcome.stderr_tail)
        self._dead(d, why, work.job)
        return True

    def _created(self) -> None:
        """A job's create went through (called from a pool thread: one float written)."""
        self._last_create = time.monotonic()

    def _room_for_others(self, work: _Work) -> bool:
        """Whether another job's create went through since this message's create was refused
        last (or, the first time, since its job started): then a capacity refusal of it is not
        the platform being full for everyone. The first refusal seen here with no such create
        is taken for the platform's (uncharged, pulling paused); once others' creates went
        through beside its refusals, every later refusal of it counts too (when the others are
        done, its refusals say nothing new about the platform)."""
        mid = work.delivery.message_id
        last, misfit = self._refused_at.pop(mid, (work.launched, False))
        misfit = misfit or self._last_create > min(last, work.launched)
        self._refused_at[mid] = (time.monotonic(), misfit)
        while len(self._refused_at) > 10_000:  # bounded: the oldest go first
            del self._refused_at[next(iter(self._refused_at))]
        return misfit

    def _dead(self, delivery: Delivery, why: DeadLetter, job: QueueJob | None) -> None:
        # The stored dead letter names both ids (docs/queues.md), whatever the broker keeps beside it.
        ident = job.message_id if job is not None else correlation_id(delivery.body)
        why = dataclasses.replace(why, id=ident, broker_id=delivery.message_id)
        self.transport.dead_letter(delivery, why)
        self._uncharged.forget(delivery.message_id)
        self._refused_at.pop(delivery.message_id, None)
        self.stats.dead_lettered += 1
        # One line per dead letter, whatever the kind: a reader finds it by either id.
        logger.warning(
            "dead-lettered: id=%s broker_id=%s kind=%s deliveries=%d%s reason=%s",
            job.message_id if job is not None else "-",
            delivery.message_id,
            why.kind,
            why.deliveries,
            f" field={why.field}" if why.field else "",
            " ".join(why.reason.split())[:500],
        )
        self.observer.dead_lettered(delivery, why.kind)

    def _dead_at_once(self, delivery: Delivery, why: DeadLetter, job: QueueJob | None) -> None:
        """Dead-letter a message that never ran; if the broker is down meanwhile, the message is
        left leased and is dead-lettered on its next delivery."""
        try:
            self._broker(functools.partial(self._dead, delivery, why, job))
        except LeaseLost as exc:
            logger.warning(
                "message %s: lease lost before it was dead-lettered (%s)", delivery.message_id, exc
            )
        except BrokerUnavailable:
            raise
        except Exception:  # e.g. the dead-letter destination refused it
            logger.exception("message %s could not be dead-lettered; left to the broker", delivery.message_id)

    # -- PandaStack outages ----------------------------------------------------------------------

    def _pause(self, outcome: JobOutcome) -> None:
        """Stop pulling (if not stopped already) and give back what was pulled and not started;
        the probe decides when to resume, never sooner than a capacity refusal's wait."""
        at_least = outcome.retry_after or 0.0
        if self.stats.api_down_since is None:
            self.stats.api_down_since = time.time()
            self.stats.api_down_reason = outcome.reason
            capacity = outcome.kind is FailureKind.CAPACITY
            self.stats.api_down_what = "out of capacity" if capacity else "unreachable"
            logger.warning(
                "PandaStack %s since %s (%s), pulling paused",
                self.stats.api_down_what,
                _clock(self.stats.api_down_since),
                outcome.reason,
            )
            self._release_pending(uncharged=True)
            self._next_probe = time.monotonic() + max(self._backoff.next(), at_least)
        else:
            self._next_probe = max(self._next_probe, time.monotonic() + at_least)

    def _check_api(self) -> None:
        """Probe the API now (unless a probe is running): a failure mid-job may be its outage. On a
        daemon thread: a probe hanging on a dead host never holds up the loop or the exit."""
        if self._probe is not None:
            return
        answer: Future[None] = Future()

        def run() -> None:
            try:
                probe(self.connection)
            except Exception as exc:  # noqa: BLE001 - read by _watch_api
                answer.set_exception(exc)
            else:
                answer.set_result(None)

        self._probe = answer
        threading.Thread(target=run, daemon=True, name="pandastack-probe").start()

    def _watch_api(self) -> None:
        """Read a finished probe: pause on failure, resume on an answer; probe again when due."""
        done = self._probe
        if done is not None and done.done():
            self._probe = None
            try:
                done.result()
            except ApiKeyRejected:
                pass  # it answers: the jobs' own failures say the rest
            except Exception as exc:  # noqa: BLE001 - unreachable, whatever the cause
                reason = str(exc)
                if self.stats.api_down_since is None:
                    self._pause(JobOutcome(ok=False, kind=FailureKind.CONNECTION, reason=reason))
                else:
                    wait = self._backoff.next()
                    self._next_probe = max(self._next_probe, time.monotonic() + wait)
                    logger.info("PandaStack still unreachable (%s); next probe in %.1fs", reason, wait)
                return
            if self.stats.api_down_since is not None and time.monotonic() >= self._next_probe:
                down = time.time() - self.stats.api_down_since
                self.stats.api_down_since, self.stats.api_down_reason = None, ""
                self._backoff.reset()
                logger.warning("PandaStack answers again after %.0fs; pulling resumed", down)
        if self.stats.api_down_since is not None and self._probe is None:
            if time.monotonic() >= self._next_probe:
                self._check_api()

    # -- leases, drain, broker outages -----------------------------------------------------------

    def _extend_leases(self) -> None:
        if not self.transport.lease_seconds:
            return
        for work in [*self._running.values(), *self._pending]:
            try:
                if (
                    self._broker(functools.partial(self.transport.extend, work.delivery), failed=False)
                    is False
                ):
                    return
            except LeaseLost as exc:
                logger.warning("message %s: could not extend its lease (%s)", work.delivery.message_id, exc)

    def _drop_lost(self) -> None:
        """Cancel the jobs, and forget the waiting messages, whose deliveries the transport lost
        (a Kafka rebalance moved their partition): their new owner runs them again, so running
        them on here would only run them twice. Their settlement then finds them lost."""
        for work in self._running.values():
            if not work.drained and self.transport.lost(work.delivery):
                logger.info("message %s: its delivery was lost; cancelling its job", work.delivery.message_id)
                work.drained = True
                work.handle.cancel()
        lost = [w for w in self._pending if self.transport.lost(w.delivery)]
        for work in lost:
            self._pending.remove(work)

    def _cancel_running(self) -> None:
        for work in self._running.values():
            if not work.drained:
                logger.info("drain deadline: cancelling the job of message %s", work.job.message_id)
                work.drained = True
                work.handle.cancel()

    def _broker(self, op: Callable[[], Any], failed: Any = None) -> Any:
        """Run a transport call; on :class:`BrokerUnavailable`, reconnect with backoff (jobs keep
        running) and return ``failed``."""
        try:
            return op()
        except BrokerUnavailable as exc:
            logger.warning("broker unavailable: %s; reconnecting", exc)
            self.observer.broker_error()
        delay = 0.2
        while True:
            self._collect()
            try:
                self.transport.connect()
                self.stats.reconnects += 1
                logger.info("broker reconnected")
                return failed
            except BrokerUnavailable as exc:
                if self._stop.is_set():
                    if self._stop_at is None:
                        self._stop_at = time.monotonic() + self.drain_seconds
                    if time.monotonic() > self._stop_at:
                        raise
                logger.debug("still unavailable: %s", exc)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
