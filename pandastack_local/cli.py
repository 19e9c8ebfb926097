"""``pandastack-local serve``: run the local PandaStack-compatible server.
``pandastack-local templates build [NAME]``: build templates' software ahead of time."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import resource
import sys
from pathlib import Path
from typing import Any

from pandastack_local.admission import ADMISSIONS, DEFAULT_ADMISSION
from pandastack_local.config import (
    API_KEY_ENV,
    DEFAULT_MAX_SANDBOXES,
    DEFAULT_POOL_SIZE,
    DEFAULT_PORT,
    DEFAULT_STREAM_BUFFER_MB,
    ServerConfig,
    default_memory_budget_mb,
    default_state_dir,
    generate_api_key,
    port_taken,
)
from pandastack_local.isolation.backend import DEFAULT_ISOLATION, ISOLATIONS
from pandastack_local.isolation.egress import EgressError, parse_rules
from pandastack_local.isolation.mountns import protect_device_nodes
from pandastack_local.limits import (
    HEADER_TIMEOUT_SECONDS,
    KEEP_ALIVE_SECONDS,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_CLIENT,
    MAX_HEADER_BYTES,
    connection_caps,
)

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pandastack-local", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT)
    serve.add_argument(
        "--api-key", default=None, help=f"bearer key (default: ${API_KEY_ENV}, else generated)"
    )
    serve.add_argument("--state-dir", type=Path, default=None, help=f"default {default_state_dir()}")
    serve.add_argument("--max-sandboxes", type=int, default=DEFAULT_MAX_SANDBOXES)
    serve.add_argument("--template-dir", action="append", default=[], help="add a template (repeatable)")
    serve.add_argument("--ttl-scan-interval", type=float, default=30.0)
    serve.add_argument(
        "--memory-budget-mb",
        type=int,
        default=None,
        help="refuse (507) a create that would take the live sandboxes past this many MB (by "
        "--admission); default: host memory minus headroom; 0 disables",
    )
    serve.add_argument(
        "--admission",
        choices=ADMISSIONS,
        default=DEFAULT_ADMISSION,
        help="usage (default): admit by the memory sandboxes actually use, and past the budget stop "
        "the jobs of the sandboxes furthest above their share, biggest first, until the total fits; "
        "limits: by the sum of their memory limits (no overcommit)",
    )
    serve.add_argument(
        "--stream-buffer-mb",
        type=int,
        default=DEFAULT_STREAM_BUFFER_MB,
        help="memory the server may hold for slow readers of exec/stream and of files (1 MiB each) "
        "and for uploads (their size), all together; past it a new one is refused (503, Retry-After)",
    )
    serve.add_argument(
        "--pool-size", type=int, default=DEFAULT_POOL_SIZE, help="pre-started sandboxes per template"
    )
    serve.add_argument(
        "--allow-egress",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="make this host endpoint reachable from inside every sandbox (repeatable)",
    )
    serve.add_argument(
        "--isolation",
        choices=ISOLATIONS,
        default=DEFAULT_ISOLATION,
        help="the boundary around each sandbox: bwrap (namespaces + seccomp, default) or gvisor "
        "(runsc's user-space kernel; needs a root server and runsc: make runsc)",
    )
    serve.add_argument(
        "--runsc", default=None, metavar="PATH", help="gVisor's runsc (default: runsc on PATH)"
    )
    serve.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        help="open connections at once (lowered to fit the descriptor limit); past it 503",
    )
    serve.add_argument(
        "--max-connections-per-client",
        type=int,
        default=MAX_CONNECTIONS_PER_CLIENT,
        help="open connections at once from one client address (at most half the total); past it 429",
    )
    serve.add_argument(
        "--header-timeout",
        type=float,
        default=HEADER_TIMEOUT_SECONDS,
        help="seconds a client has to send a request's headers (408 past it)",
    )
    serve.add_argument(
        "--metrics-without-key",
        action="store_true",
        help="serve GET /metrics without the API key (a scraper on a trusted network; default: key needed)",
    )
    serve.add_argument("--log-level", default="warning")
    serve.add_argument("--cache-dir", type=Path, default=None, help="built templates (default ~/.cache/...)")
    templates = sub.add_parser("templates", help="manage templates")
    tsub = templates.add_subparsers(dest="action", required=True)
    build = tsub.add_parser("build", help="build templates' software now (cached; servers reuse it)")
    build.add_argument("names", nargs="*", metavar="NAME", help="default: every template")
    build.add_argument("--template-dir", action="append", default=[], help="add a template (repeatable)")
    build.add_argument("--cache-dir", type=Path, default=None)
    return parser


def build_templates(args: argparse.Namespace) -> int:
    from pandastack_local.templates.build import TemplateBuildError, build, default_cache_dir
    from pandastack_local.templates.registry import TemplateError, template_registry

    try:
        registry = template_registry(tuple(args.template_dir))
    except TemplateError as exc:
        print(f"pandastack-local: {exc}", file=sys.stderr)
        return 2
    unknown = sorted(set(args.names) - set(registry))
    if unknown:
        print(f"pandastack-local: unknown template(s) {unknown}; known: {sorted(registry)}", file=sys.stderr)
        return 2
    failed = 0
    for name in args.names or sorted(registry):
        t = registry[name]
        if not t.needs_build:
            print(f"pandastack-local: template {name}: nothing to build", flush=True)
            continue
        try:
            path = build(
                name, t.requirements, t.debs, args.cache_dir or default_cache_dir(), _progress, t.verify
            )
        except TemplateBuildError as exc:
            print(f"pandastack-local: {exc}", file=sys.stderr, flush=True)
            failed += 1
            continue
        print(f"pandastack-local: template {name}: ready at {path}", flush=True)
    return 1 if failed else 0


def _progress(line: str) -> None:
    print(f"pandastack-local: {line}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "templates":
        sys.exit(build_templates(args))
    try:
        parse_rules(args.allow_egress)
    except EgressError as exc:
        parser.error(str(exc))
    if args.isolation == "gvisor":
        from pandastack_local.isolation.gvisor.backend import RunscUnavailable, check_runsc

        if args.allow_egress:
            parser.error("--allow-egress is not supported with --isolation gvisor (no network at all)")
        try:
            check_runsc(args.runsc)
        except RunscUnavailable as exc:
            print(f"pandastack-local: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)
    logging.basicConfig(level=logging.INFO, format="pandastack-local: %(message)s", stream=sys.stderr)
    from pandastack_local.api.connections import RepeatFilter

    for handler in logging.getLogger().handlers:
        handler.addFilter(RepeatFilter())
    # Before any thread exists: a mount namespace cannot be unshared by a multi-threaded process.
    try:
        protect_device_nodes()
    except OSError as exc:
        log.warning("isolation: device nodes stay writable: %s", exc)
    try:
        import uvicorn

        from pandastack_local.api.app import create_app
    except ImportError as exc:  # the base install is the adapters only; the server is an extra
        from pandastack_workflows.install import install_line

        raise SystemExit(
            f"pandastack-local: {exc.name or exc} is not installed. The server is the [local] extra: "
            f"{install_line('local')} (beside a queue worker: [queue,local])"
        ) from None

    if taken := port_taken(args.host, args.port):
        raise SystemExit(taken)
    key = args.api_key or os.environ.pop(API_KEY_ENV, None)
    if not key:
        key = generate_api_key()
        print(f"pandastack-local: generated API key (shown once): {key}", flush=True)
    config = ServerConfig(
        api_key=key,
        state_dir=args.state_dir or default_state_dir(),
        max_sandboxes=args.max_sandboxes if args.max_sandboxes and args.max_sandboxes > 0 else None,
        admission=args.admission,
        memory_budget_mb=(
            default_memory_budget_mb() if args.memory_budget_mb is None else (args.memory_budget_mb or None)
        ),
        ttl_scan_interval=args.ttl_scan_interval,
        template_dirs=tuple(args.template_dir),
        pool_size=max(args.pool_size, 0),
        allow_egress=tuple(args.allow_egress),
        cache_dir=args.cache_dir,
        isolation=args.isolation,
        runsc=args.runsc,
        stream_buffer_mb=max(args.stream_buffer_mb, 1),
        metrics_without_key=args.metrics_without_key,
    )
    print(f"pandastack-local: listening on http://{args.host}:{args.port}", flush=True)
    uvicorn.Server(server_config(args, create_app(config), uvicorn)).run()


def server_config(args: argparse.Namespace, app: object, uvicorn: Any) -> Any:
    """uvicorn's settings, its HTTP protocol guarded (api/connections.py) with caps that fit the
    descriptor limit (raised to the hard limit first)."""
    from pandastack_local.api.connections import ConnectionGuard, guarded_protocol
    from pandastack_local.metrics import watch_connections

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    sandboxes = (args.max_sandboxes if args.max_sandboxes and args.max_sandboxes > 0 else 100) + 4 * max(
        args.pool_size, 0
    )
    total, per_client = connection_caps(
        soft, max(args.max_connections, 1), max(args.max_connections_per_client, 1), sandboxes
    )
    log.warning(
        "connections: at most %d at once, %d per client address (descriptor limit %d); headers within "
        "%g s, idle keep-alive %d s",
        total,
        per_client,
        soft,
        args.header_timeout,
        KEEP_ALIVE_SECONDS,
    )
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]
    guard = ConnectionGuard(total, per_client, max(args.header_timeout, 0.1))
    watch_connections(app, guard)
    return uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_config=None,  # the root handler's RepeatFilter sees uvicorn's lines too
        access_log=False,
        http=guarded_protocol(base, guard),
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )
