"""OpenTelemetry spans for every job, off and free when OpenTelemetry is absent (the ``[otel]`` extra).

The span tree of one job (docs/observability.md, "Traces")::

    pandastack.job                      the lifecycle (every adapter: Airflow, Prefect, the queue)
      pandastack.create | deliver | exec | collect | delete

and, on a queue consumer, ``process <queue>`` (a CONSUMER span with the OpenTelemetry messaging
attributes) as the job span's parent, linked to the producer's context when the message carried a
W3C ``traceparent``. The spans go to whatever tracer provider the process configured (the SDK's, an
engine's); without one the API's no-op tracer makes them cost next to nothing. No span carries the
API key, the command, the input or a message body: only the ids, the template and the outcome.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

try:  # the [otel] extra; without it every helper here is a no-op
    from opentelemetry import trace
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # pragma: no cover - exercised by the absence test
    trace = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from .outcome import JobOutcome
    from .spec import JobSpec

TRACER_NAME = "pandastack_jobs"
STEPS = ("create", "deliver", "exec", "collect", "delete")
# W3C trace context: version 00, a 32-hex trace id and a 16-hex span id (neither all zeros),
# two hex flags. Anything else a producer wrote is ignored, never raised on.
_TRACEPARENT = re.compile(r"^00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$")
TRACEPARENT_MAX = 55


def enabled() -> bool:
    """True when the OpenTelemetry API is importable (spans then go to the configured provider)."""
    return trace is not None


_TRACER: Any = None


def _tracer() -> Any:
    """The package's tracer, got once (the SDK's ``get_tracer`` builds a new one per call). Got before
    a provider is set, it is the API's proxy, which follows the provider set later."""
    global _TRACER
    if _TRACER is None:
        _TRACER = trace.get_tracer(TRACER_NAME)
    return _TRACER


def valid_traceparent(value: object) -> str | None:
    """``value`` as a W3C ``traceparent`` if it is one (bytes or str, at most 55 characters), else None.

    It comes from whoever wrote the message: untrusted, so anything else is dropped silently."""
    if isinstance(value, bytes | bytearray):
        if len(value) > TRACEPARENT_MAX:
            return None
        try:
            value = bytes(value).decode("ascii")
        except UnicodeDecodeError:
            return None
    if not isinstance(value, str) or len(value) > TRACEPARENT_MAX:
        return None
    value = value.strip().lower()
    return value if _TRACEPARENT.match(value) else None


def current_traceparent() -> str | None:
    """The current span's context as a ``traceparent`` (what a producer writes on a message)."""
    if trace is None:
        return None
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return valid_traceparent(carrier.get("traceparent"))


def _context_of(traceparent: str | None) -> Any:
    if trace is None or traceparent is None:
        return None
    span_context = trace.get_current_span(
        TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    ).get_span_context()
    return span_context if span_context.is_valid else None


@contextlib.contextmanager
def send_span(system: str, destination: str) -> Iterator[str | None]:
    """A PRODUCER ``send <destination>`` span around one enqueue; yields the ``traceparent`` to write
    on the message (None without OpenTelemetry)."""
    if trace is None:
        yield None
        return
    attributes = {
        "messaging.system": system,
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": destination,
    }
    with _tracer().start_as_current_span(
        f"send {destination}", kind=SpanKind.PRODUCER, attributes=attributes
    ):
        yield current_traceparent()


@contextlib.contextmanager
def process_span(
    system: str,
    destination: str,
    message_id: str,
    delivery: int,
    traceparent: object = None,
    conversation_id: str | None = None,
) -> Iterator[Any]:
    """The consumer's ``process <destination>`` span (OpenTelemetry messaging conventions), linked to
    the producer's span when ``traceparent`` (from the message, untrusted) is a valid one."""
    if trace is None:
        yield None
        return
    links = []
    producer = _context_of(valid_traceparent(traceparent))
    if producer is not None:
        links.append(Link(producer))
    attributes: dict[str, Any] = {
        "messaging.system": system,
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": destination,
        "messaging.message.id": str(message_id)[:256],
        "messaging.message.delivery_count": int(delivery),
    }
    if conversation_id:  # the message's own id (its correlation id), not the broker's
        attributes["messaging.message.conversation_id"] = str(conversation_id)[:256]
    with _tracer().start_as_current_span(
        f"process {destination}", kind=SpanKind.CONSUMER, attributes=attributes, links=links
    ) as span:
        yield span


@contextlib.contextmanager
def job_span(spec: JobSpec) -> Iterator[Any]:
    """The span of one job's whole lifecycle, a child of whatever span is current (an engine's task
    run, the consumer's ``process`` span). Yields the span (None without OpenTelemetry)."""
    if trace is None:
        yield None
        return
    attributes: dict[str, Any] = {"pandastack.template": spec.template}
    if spec.key is not None:
        attributes["pandastack.engine"] = str(getattr(spec.key.engine, "value", spec.key.engine))
        attributes["pandastack.try_number"] = spec.key.try_number
    with _tracer().start_as_current_span(
        "pandastack.job", attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as span:
        yield span


@contextlib.contextmanager
def step_span(name: str) -> Iterator[None]:
    """A child span for one lifecycle step (``create``, ``deliver``, ``exec``, ``collect``, ``delete``).

    Exceptions are not recorded on it: their text can carry a server's answer, and the job span's
    outcome attributes say what went wrong in words the lifecycle redacted."""
    if trace is None:
        yield
        return
    with _tracer().start_as_current_span(
        f"pandastack.{name}", record_exception=False, set_status_on_exception=False
    ):
        yield


def end_job(span: Any, outcome: JobOutcome) -> None:
    """Put the sandbox id, the outcome and its class on the job span."""
    if span is None or not span.is_recording():
        return
    attributes: dict[str, Any] = {
        "pandastack.outcome": "ok" if outcome.ok else "failed",
        "pandastack.outcome.class": outcome_class(outcome),
    }
    if outcome.sandbox_id:
        attributes["pandastack.sandbox.id"] = outcome.sandbox_id
    if outcome.kind is not None:
        attributes["pandastack.failure.kind"] = outcome.kind.value
    if outcome.exit_code is not None:
        attributes["pandastack.exit_code"] = outcome.exit_code
    span.set_attributes(attributes)
    if not outcome.ok:
        span.set_status(Status(StatusCode.ERROR, outcome.kind.value if outcome.kind else "failed"))


def outcome_class(outcome: JobOutcome) -> str:
    """``ok``, ``redeliver`` or ``dead_letter``: the three ways a job can end."""
    if outcome.ok:
        return "ok"
    return outcome.failure_class.value if outcome.failure_class is not None else "dead_letter"


def set_attributes(span: Any, attributes: Mapping[str, Any]) -> None:
    """Set ``attributes`` on ``span`` if it records (None, or a no-op span: nothing)."""
    if span is not None and span.is_recording():
        span.set_attributes(dict(attributes))
