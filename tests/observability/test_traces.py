"""Issue 38: the span tree of a job through the queue consumer, with the producer's trace context
carried across a real Redis (``pandastack-jobs send`` writes it; the consumer's ``process`` span
links to it), read back with the OpenTelemetry SDK's in-memory exporter."""

from __future__ import annotations

import json
import threading
import uuid

import pytest
from opentelemetry import trace

from e2e.brokers import Kafka, Redis
from pandastack_jobs import ConnectionConfig
from pandastack_jobs.queue import Consumer, batch_done, open_transport
from pandastack_jobs.queue.cli import main as jobs_cli
from pandastack_local import LocalServer
from tests.support.otel import STEPS, all_text, children, exporter, named


def consume(server: LocalServer, url: str, n: int) -> None:
    conn = ConnectionConfig(api_url=server.url, api_key=server.api_key)
    c = Consumer(open_transport(url, 5), conn, defaults={"template": "base", "timeout": 30}, max_deliveries=1)
    t = threading.Thread(target=c.run, args=(batch_done(n, 30),), daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), c.stats
    assert c.stats.received == n, c.stats


def test_a_job_through_redis_is_one_trace_from_send_to_delete(
    local_server: LocalServer, redis_broker: Redis
) -> None:
    spans_out = exporter()
    queue = f"q{uuid.uuid4().hex[:8]}"
    url = redis_broker.url(queue)
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("producer"):
        body = json.dumps({"id": "m1", "command": 'echo \'{"n": 1}\' > "$JOB_RESULT"', "tenant": "acme"})
        assert jobs_cli(["send", "--broker", url, body]) == 0
    # The context rode on the entry as a traceparent field.
    [(_, fields)] = redis_broker.r.xrange(queue)
    assert fields[b"traceparent"].startswith(b"00-")
    consume(local_server, url, 1)

    spans = spans_out.get_finished_spans()
    [send] = named(spans, f"send {queue}")
    assert send.kind is trace.SpanKind.PRODUCER
    assert send.attributes["messaging.system"] == "redis"
    [process] = named(spans, f"process {queue}")
    assert process.kind is trace.SpanKind.CONSUMER
    attrs = dict(process.attributes or {})
    assert attrs["messaging.operation.type"] == "process"
    assert attrs["messaging.destination.name"] == queue
    assert attrs["messaging.message.id"].count("-") == 1  # the broker's id (a stream entry id)
    assert attrs["messaging.message.conversation_id"] == "m1"
    assert attrs["messaging.system"] == "redis"
    # Linked to the producer's send span, across the broker.
    assert [link.context.span_id for link in process.links] == [send.context.span_id]
    assert process.links[0].context.trace_id == send.context.trace_id
    [job] = children(spans, process)
    assert job.name == "pandastack.job"
    assert [s.name for s in children(spans, job)] == STEPS
    jattrs = dict(job.attributes or {})
    assert jattrs["pandastack.template"] == "base"
    assert jattrs["pandastack.outcome.class"] == "ok"
    assert jattrs["pandastack.sandbox.id"]
    assert local_server.api_key not in all_text(spans)


@pytest.mark.parametrize(
    "traceparent",
    [b"garbage", b"00-" + b"0" * 32 + b"-" + b"1" * 16 + b"-01", b"\xff\xfe" * 40, b"00-" + b"a" * 500],
)
def test_a_bad_traceparent_from_the_producer_is_ignored(
    local_server: LocalServer, redis_broker: Redis, traceparent: bytes
) -> None:
    """The field is producer-written: a malformed one makes no link and never fails the message."""
    spans_out = exporter()
    queue = f"q{uuid.uuid4().hex[:8]}"
    body = json.dumps({"id": "m2", "command": "exit 2"})
    redis_broker.r.xadd(queue, {"body": body, "traceparent": traceparent})
    consume(local_server, redis_broker.url(queue), 1)
    [process] = named(spans_out.get_finished_spans(), f"process {queue}")
    assert list(process.links) == []
    [job] = children(spans_out.get_finished_spans(), process)
    assert job.attributes["pandastack.outcome.class"] == "redeliver"
    assert job.attributes["pandastack.failure.kind"] == "exit_code"
    assert [why["why"]["kind"] for why in redis_broker.dead(queue)] == ["exit_code"]


def test_a_job_through_kafka_links_to_its_producer_across_a_retry(
    local_server: LocalServer, kafka_broker: Kafka
) -> None:
    """Kafka carries the context as a ``traceparent`` record header, and its retry topic keeps it:
    the process span of the failed first delivery and that of the second both link to the send."""
    spans_out = exporter()
    queue = f"q{uuid.uuid4().hex[:8]}"
    url = kafka_broker.url(queue)
    tracer = trace.get_tracer("test")
    flaky = '[ "$QUEUE_DELIVERY" -ge 2 ] || exit 75; echo \'{"n": 1}\' > "$JOB_RESULT"'
    with tracer.start_as_current_span("producer"):
        assert jobs_cli(["send", "--broker", url, json.dumps({"id": "m1", "command": flaky})]) == 0
    [record] = kafka_broker.records(queue)
    assert dict(record.headers())["traceparent"].startswith(b"00-")
    conn = ConnectionConfig(api_url=local_server.url, api_key=local_server.api_key)
    c = Consumer(
        open_transport(url, 5),
        conn,
        defaults={"template": "base", "timeout": 30},
        max_deliveries=2,
        release_delay=0.5,
    )
    t = threading.Thread(target=c.run, args=(lambda s: s.acked >= 1,), daemon=True)
    t.start()
    t.join(90)
    assert not t.is_alive(), c.stats
    assert (c.stats.received, c.stats.redelivered, c.stats.acked) == (2, 1, 1), c.stats

    spans = spans_out.get_finished_spans()
    [send] = named(spans, f"send {queue}")
    assert send.attributes["messaging.system"] == "kafka"
    processes = named(spans, f"process {queue}")
    assert len(processes) == 2
    for process in processes:
        assert process.attributes["messaging.system"] == "kafka"
        assert [link.context.span_id for link in process.links] == [send.context.span_id]
    assert local_server.api_key not in all_text(spans)


@pytest.mark.parametrize("traceparent", [b"garbage", b"00-" + b"a" * 500, b"\xff\xfe" * 40])
def test_a_bad_traceparent_header_on_kafka_is_ignored(
    local_server: LocalServer, kafka_broker: Kafka, traceparent: bytes
) -> None:
    """The header is producer-written: a malformed one makes no link and never fails the message."""
    from confluent_kafka import Producer

    spans_out = exporter()
    queue = f"q{uuid.uuid4().hex[:8]}"
    url = kafka_broker.url(queue)
    open_transport(url, 5).connect()  # the topics, with the transport's partitions
    p = Producer({"bootstrap.servers": f"127.0.0.1:{kafka_broker.port}"})
    p.produce(
        queue, value=json.dumps({"id": "m2", "command": "exit 2"}), headers=[("traceparent", traceparent)]
    )
    assert p.flush(10) == 0
    consume(local_server, url, 1)
    [process] = named(spans_out.get_finished_spans(), f"process {queue}")
    assert list(process.links) == []
    assert [why["why"]["kind"] for why in kafka_broker.dead(queue)] == ["exit_code"]
