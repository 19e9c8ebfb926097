"""The HTTP API's routers, one per resource; ``app.create_app`` mounts them in this order."""

from __future__ import annotations

from fastapi import APIRouter

from . import exec, fs, lifecycle, sandboxes, service, templates

ROUTERS: tuple[APIRouter, ...] = (
    service.router,
    sandboxes.router,
    templates.router,
    exec.router,
    fs.router,
    lifecycle.router,
)
