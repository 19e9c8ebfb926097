"""``GET /metrics``: the server's Prometheus metrics (docs/observability.md lists every one).

Counts that the server keeps anyway (live sandboxes, memory, the teardown backlog, the connection
guard's refusals, the pressure guard's actions) are read when Prometheus scrapes; the rest are
observed where they happen through :class:`ServerMetrics`' few methods, which the manager calls in
one line each. Every label value comes from a fixed set (methods, route templates, statuses,
create modes, refusal reasons) or from the server's own template names, validated and capped: a
sandbox id, a command, a client address or anything else a client picks is never a label, so the
number of series stays fixed however many jobs run.

The endpoint takes the API key as a bearer token (Prometheus' ``authorization`` scrape setting
sends it); ``--metrics-without-key`` serves it to anyone who can reach the listener (a trusted
network's scraper). The key is never in a metric.
"""

from __future__ import annotations

import hmac
import re
import threading
import time
from collections import Counter as Tally
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from collections.abc import Callable

    from fastapi import FastAPI

# The manager (pandastack_local.manager.SandboxManager) imports this module for its counters, so
# it is typed by what is read of it here, not imported (the packages import no circle).
SandboxManager = Any

MAX_TEMPLATE_LABELS = 64
_TEMPLATE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
CREATE_MODES = frozenset({"cold", "pool", "snapshot", "fork"})
DELETE_CAUSES = frozenset({"api", "ttl", "cleanup"})
REFUSALS = ("count_cap", "memory", "never_fits", "template_not_ready")
GUARD_ACTIONS = ("job_stopped", "sandbox_stopped")
STATES = frozenset({"running", "paused", "failed", "deleted", "stopping"})
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
EXEC_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600)


class ServerMetrics:
    """The server's metrics in a registry of its own (one server per process, but tests may build
    several apps in one)."""

    def __init__(self, manager: SandboxManager) -> None:
        self.manager = manager
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self._templates: set[str] = set()
        self._lock = threading.Lock()
        self.refusals: Tally[str] = Tally()
        self.forks: Tally[str] = Tally()
        self.connections: Any = None  # the ConnectionGuard (api/connections.py), set by the CLI
        self.create = Histogram(
            "pandastack_local_sandbox_create_seconds",
            "Time to create a sandbox (its agent answering), by template and how it started.",
            ["template", "mode"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.delete = Histogram(
            "pandastack_local_sandbox_delete_seconds",
            "Time to delete a sandbox (stopped for its clients; removal finishes in the background).",
            ["cause"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.http = Histogram(
            "pandastack_local_http_request_duration_seconds",
            "HTTP requests by method, route template and status.",
            ["method", "route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.exec = Histogram(
            "pandastack_local_exec_seconds",
            "Exec requests from start to answer (sync) or to the stream's end (stream).",
            ["mode"],
            buckets=EXEC_BUCKETS,
            registry=reg,
        )
        for cause in DELETE_CAUSES:
            self.delete.labels(cause)
        for mode in ("sync", "stream"):
            self.exec.labels(mode)
        reg.register(_StateCollector(self))

    # -- called by the manager (one line each) ---------------------------------------------------

    def template(self, name: str) -> str:
        """A template name as a label value: the server's own names, checked and capped."""
        with self._lock:
            if name in self._templates:
                return name
            if not _TEMPLATE_NAME.match(name) or len(self._templates) >= MAX_TEMPLATE_LABELS:
                return "other"
            self._templates.add(name)
            return name

    def created(self, template: str, mode: str, seconds: float) -> None:
        self.create.labels(self.template(template), mode if mode in CREATE_MODES else "other").observe(
            seconds
        )

    def deleted(self, cause: str, seconds: float) -> None:
        self.delete.labels(cause if cause in DELETE_CAUSES else "cleanup").observe(seconds)

    def refused(self, reason: str) -> None:
        self.refusals[reason if reason in REFUSALS else "other"] += 1

    def forked(self, kind: str, children: int) -> None:
        self.forks["memory" if kind == "memory" else "disk"] += children

    # -- serving ---------------------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    """What the server keeps anyway, read at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        m = self.metrics
        manager = m.manager
        live = GaugeMetricFamily(
            "pandastack_local_sandboxes",
            "Sandboxes in the registry, by template and state.",
            labels=["template", "state"],
        )
        counts: Tally[tuple[str, str]] = Tally()
        for sb in list(manager.sandboxes.values()):
            state = sb.status if sb.status in STATES else "other"
            counts[(m.template(sb.template.name), state)] += 1
        for (template, state), n in sorted(counts.items()):
            live.add_metric([template, state], n)
        yield live
        pool = GaugeMetricFamily(
            "pandastack_local_pool_sandboxes",
            "Pre-started sandboxes waiting, by template.",
            labels=["template"],
        )
        for name, ready in list(manager.pool.items()):
            pool.add_metric([m.template(name)], len(ready))
        yield pool
        yield GaugeMetricFamily(
            "pandastack_local_creates_in_progress",
            "Creates admitted and not finished.",
            value=manager.pending,
        )
        yield GaugeMetricFamily(
            "pandastack_local_teardown_backlog",
            "Deleted sandboxes whose removal (cgroups, directory) has not finished.",
            value=manager.tearing_down,
        )
        admission = manager.admission
        if admission.budget_mb is not None:
            yield GaugeMetricFamily(
                "pandastack_local_memory_budget_bytes",
                "The memory budget sandboxes are admitted against.",
                value=admission.budget_mb * 1024 * 1024,
            )
        charged = admission.used_mb(manager._occupants()) + manager.pending_memory_mb * (
            admission.policy == "limits"
        )
        yield GaugeMetricFamily(
            "pandastack_local_memory_charged_bytes",
            "Memory charged against the budget: what sandboxes use (usage admission) or their limits.",
            value=charged * 1024 * 1024,
        )
        yield GaugeMetricFamily(
            "pandastack_local_memory_guard_watched_sandboxes",
            "Sandboxes whose job the pressure guard stopped and whose memory it still watches.",
            value=len(admission.job_stopped),
        )
        guard = CounterMetricFamily(
            "pandastack_local_memory_guard_actions",
            "The pressure guard's actions: job_stopped (a sandbox's job stopped, furthest above its "
            "share first), sandbox_stopped (a sandbox whose memory stayed after its job was stopped).",
            labels=["action"],
        )
        guard_counts = admission.counts
        guard.add_metric(["job_stopped"], guard_counts.jobs_stopped)
        guard.add_metric(["sandbox_stopped"], guard_counts.sandboxes_stopped)
        yield guard
        yield CounterMetricFamily(
            "pandastack_local_memory_guard_passes",
            "Guard passes that measured the sandboxes' memory (one per interval while any sandbox "
            "exists): a counter that stops moving is a stalled guard.",
            value=guard_counts.passes,
        )
        yield CounterMetricFamily(
            "pandastack_local_memory_guard_passes_over_budget",
            "Guard passes that found the sandboxes' memory over the budget.",
            value=guard_counts.passes_over_budget,
        )
        refusals = CounterMetricFamily(
            "pandastack_local_refusals",
            "Requests refused for capacity: creates (count cap 503, memory 507, template not ready 503) "
            "and connections (per client address 429, server total 503).",
            labels=["reason"],
        )
        for reason in REFUSALS:
            refusals.add_metric([reason], m.refusals.get(reason, 0))
        conn = m.connections
        refusals.add_metric(["connections_per_client"], getattr(conn, "refused_per_client", 0))
        refusals.add_metric(["connections_total"], getattr(conn, "refused_total", 0))
        yield refusals
        if conn is not None:
            yield GaugeMetricFamily(
                "pandastack_local_connections_open", "Open HTTP connections.", value=conn.open
            )
        forks = CounterMetricFamily(
            "pandastack_local_fork_children",
            "Sandboxes made by fork: memory (checkpoint and restore, gVisor) or disk (a copy of the files).",
            labels=["kind"],
        )
        for kind in ("memory", "disk"):
            forks.add_metric([kind], m.forks.get(kind, 0))
        yield forks
        yield GaugeMetricFamily(
            "pandastack_local_start_time_seconds",
            "When the server started (epoch seconds).",
            value=manager.started,
        )


class HttpMetrics:
    """Pure ASGI (no buffering of SSE streams): each request's method, route template, status and
    duration; exec requests also as ``pandastack_local_exec_seconds``."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = [500]

        async def send_status(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            seconds = time.monotonic() - started
            route = scope.get("route")
            path = getattr(route, "path", None)
            template = path if isinstance(path, str) and len(path) <= 200 else "unmatched"
            method = scope.get("method", "")
            method = method if method in METHODS else "OTHER"
            code = status[0] if 100 <= status[0] <= 599 else 500
            self.metrics.http.labels(method, template, str(code)).observe(seconds)
            if method == "POST" and template.endswith("/exec"):
                self.metrics.exec.labels("sync").observe(seconds)
            elif method == "POST" and template.endswith("/exec/stream"):
                self.metrics.exec.labels("stream").observe(seconds)


def install(
    app: FastAPI,
    manager: SandboxManager,
    expected: bytes,
    public: bool,
    bearer_token: Callable[[Any], bytes],
) -> None:
    """Serve ``GET /metrics`` on ``app`` (with ``expected``, ``Bearer <key>``, unless ``public``;
    ``bearer_token`` reads the token as the API does) and time every request."""
    metrics = manager.metrics

    async def serve_metrics(request: Request) -> Response:
        if not public:
            token = bearer_token(request.scope)
            if not token or not hmac.compare_digest(b"Bearer " + token, expected):
                detail = "missing bearer token" if not token else "invalid api token"
                return JSONResponse(
                    {
                        "error": "unauthorized",
                        "detail": f"{detail}: /metrics takes the API key as a bearer token "
                        "(Prometheus: authorization: {credentials: ...}), or start the server with "
                        "--metrics-without-key on a trusted network",
                    },
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_api_route("/metrics", serve_metrics, methods=["GET"], include_in_schema=False)
    app.add_middleware(HttpMetrics, metrics=metrics)


def watch_connections(app: Any, guard: Any) -> None:
    """Let ``/metrics`` read the connection guard's counts (the CLI makes the guard after the app)."""
    manager = getattr(getattr(app, "state", None), "manager", None)
    if manager is not None:
        manager.metrics.connections = guard
