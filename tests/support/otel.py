"""The OpenTelemetry SDK's in-memory exporter as this process's tracer provider (set once: the
API refuses a second global provider), and the span tree read back from it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_EXPORTER: InMemorySpanExporter | None = None

# The lifecycle's step spans under one job's span, in start order (pandastack_jobs/tracing.py).
STEPS = [
    "pandastack.create",
    "pandastack.deliver",
    "pandastack.exec",
    "pandastack.collect",
    "pandastack.delete",
]


def exporter() -> InMemorySpanExporter:
    """The process's in-memory exporter, cleared (installing the SDK provider on first use)."""
    global _EXPORTER
    if _EXPORTER is None:
        _EXPORTER = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)
        assert trace.get_tracer_provider() is provider, "another tracer provider was set first"
    _EXPORTER.clear()
    return _EXPORTER


def children(spans: Iterable[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    """The spans whose parent is ``parent``, in start order."""
    pid = parent.context.span_id
    out = [s for s in spans if s.parent is not None and s.parent.span_id == pid]
    return sorted(out, key=lambda s: s.start_time or 0)


def named(spans: Iterable[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def all_text(spans: Iterable[ReadableSpan]) -> str:
    """Every name, attribute, event and status of ``spans`` as one string (to look for a secret)."""
    parts: list[Any] = []
    for s in spans:
        parts += [s.name, dict(s.attributes or {}), s.status.description]
        parts += [(e.name, dict(e.attributes or {})) for e in s.events]
    return repr(parts)
