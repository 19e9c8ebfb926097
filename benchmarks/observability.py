"""Issue 38's overhead step: the same small job with metrics and tracing on and off, side by side.

Run in ``.venv-airflow``: ``python -m benchmarks.observability [--rounds R --batch B]``.
``off``: the core's ``run_job`` with OpenTelemetry switched off as if the ``[otel]`` extra were
absent, and the queue consumer's no-op observer. ``on``: the OpenTelemetry SDK as the tracer
provider with a batch processor into an exporter that keeps the spans (six per job: the job and
its five steps), and the consumer's metric hooks (received, settled, acked) called per job. The
server's ``/metrics`` bookkeeping runs in both (it is always on); its own cost per request is
measured apart, with the same histograms the server observes, and reported per job. Batches of
the two are interleaved with a rotating order so drift hits both alike.
"""

from __future__ import annotations

import time
import timeit
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from benchmarks.common import (
    EXPECTED,
    JOB_CODE,
    JOB_INPUT,
    JOB_TIMEOUT,
    interleaved,
    log,
    machine,
    write_json,
)
from benchmarks.options import int_options
from benchmarks.overhead import report

# The HTTP requests one job makes (create, the exec stream, delete, and a few reads): an upper bound.
REQUESTS_PER_JOB = 6


def job_variant(client: Any, tracing_on: bool, observer: Any) -> Callable[[], Any]:
    import pandastack_jobs.tracing as tracing
    from pandastack_jobs import JobSpec, run_job
    from pandastack_jobs.queue import Delivery

    otel = tracing.trace
    spec = JobSpec(command="python3 run.py", files={"run.py": JOB_CODE}, input=JOB_INPUT, timeout=JOB_TIMEOUT)

    def run() -> Any:
        tracing.trace = otel if tracing_on else None  # type: ignore[assignment]
        try:
            delivery = Delivery("bench", b"{}", 1, extra={"sent": time.time()})
            observer.received(delivery)
            outcome = run_job(client, spec)
            observer.settled(delivery, outcome)
            observer.acked(delivery)
        finally:
            tracing.trace = otel  # type: ignore[assignment]
        assert outcome.ok and outcome.result == EXPECTED, outcome.reason
        return outcome.result

    return run


def server_cost_us() -> float:
    """Microseconds the server's metrics add to one job's requests (the middleware's observe calls)."""
    from prometheus_client import CollectorRegistry, Histogram

    from pandastack_local.metrics import LATENCY_BUCKETS

    h = Histogram(
        "x_seconds", "x", ["method", "route", "status"], buckets=LATENCY_BUCKETS, registry=CollectorRegistry()
    )
    n = 20000
    seconds = timeit.timeit(
        lambda: h.labels("POST", "/v1/sandboxes/{sandbox_id}/exec", "200").observe(0.01), number=n
    )
    return round(seconds / n * 1e6 * REQUESTS_PER_JOB, 2)


def instrumentation_us(metrics: Any, n: int = 400) -> dict[str, float]:
    """The same job on the fake client (no server, no sandbox: what is left is the core's own work),
    off and on, interleaved: the difference is what metrics and tracing add to one job, in µs."""
    from pandastack_jobs.queue.metrics import Observer
    from pandastack_jobs.testing import FakeClient

    fake = FakeClient()
    fake.script("run.py", result=EXPECTED)
    off = job_variant(fake, False, Observer())
    on = job_variant(fake, True, metrics)
    times: dict[str, list[float]] = {"off": [], "on": []}
    for i in range(n):
        for name, fn in (("off", off), ("on", on)) if i % 2 else (("on", on), ("off", off)):
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    med = {k: sorted(v)[len(v) // 2] * 1e6 for k, v in times.items()}
    return {
        "off_us": round(med["off"], 1),
        "on_us": round(med["on"], 1),
        "added_us": round(med["on"] - med["off"], 1),
    }


def main() -> None:
    args = int_options(rounds=6, batch=5)
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pandastack_jobs.queue import Stats
    from pandastack_jobs.queue.metrics import ConsumerMetrics, Observer
    from pandastack_local import LocalServer

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)

    # The hooks only (no loop runs): a stand-in with the two attributes a scrape reads.
    metrics = ConsumerMetrics(SimpleNamespace(stats=Stats(), concurrency=1))  # type: ignore[arg-type]
    with LocalServer() as server:
        client = server.client()
        variants = {
            "off": job_variant(client, False, Observer()),
            "on": job_variant(client, True, metrics),
        }
        log(f"observability overhead: {args.rounds} rounds x {args.batch} jobs x 2 variants")
        samples = interleaved(variants, args.rounds, args.batch)
        assert client.sandboxes.list() == [], "a variant leaked a sandbox"
    provider.force_flush()
    spans = len(exporter.get_finished_spans())
    out = report(samples, "off", args.batch)
    fake = instrumentation_us(metrics)
    server_us = server_cost_us()
    added = fake["added_us"] + server_us
    share = round(added / (out["off"]["p50_ms"] * 1000), 5)
    data = {
        "machine": machine(),
        "n_per_variant": args.rounds * args.batch,
        "rounds": args.rounds,
        "batch": args.batch,
        "spans_exported": spans,
        "server_metrics_us_per_job": server_us,
        "fake_client_us_per_job": fake,
        # What metrics and tracing add to a job (client side on the fake, plus the server's
        # bookkeeping), over the real job's median: the figure held to issue 38's 2 %.
        "added_share_of_job": share,
        **out,
        "samples_ms": {k: [round(v * 1000, 2) for v in vs] for k, vs in samples.items()},
    }
    log(f"on/off paired ratio {out['ratios']['on/off']['paired']} (noisy); spans {spans}")
    log(f"added per job: {added:.0f} us = {share:.2%} of the job's median ({fake}, server {server_us} us)")
    log(f"observability overhead written to {write_json('observability', data)}")


if __name__ == "__main__":
    main()
