"""The HTTP API's routers, one per resource; ``app.create_app`` mounts them in this order (the
not-supported answers last, but for the few static paths a real route's parameter would take)."""

from __future__ import annotations

from fastapi import APIRouter

from . import code_contexts, exec, fs, lifecycle, repl, sandboxes, service, templates, unsupported

ROUTERS: tuple[APIRouter, ...] = (
    service.router,
    unsupported.shadowed_router,
    sandboxes.router,
    templates.router,
    exec.router,
    fs.router,
    lifecycle.router,
    code_contexts.router,
    repl.router,
    unsupported.router,
)
