"""Unauthenticated service routes: health and version (outside ``/v1``, so no bearer auth)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from pandastack_local import __version__

from .deps import Manager

router = APIRouter()


@router.get("/healthz")
async def healthz(manager: Manager) -> dict[str, Any]:
    return {
        "status": "ok",
        "sandboxes": len(manager.sandboxes),
        "tearing_down": manager.tearing_down,
        "isolation": manager.backend.name,
        "memory": manager.memory_health(),
    }


@router.get("/version")
async def version(manager: Manager) -> dict[str, Any]:
    return {
        "version": __version__,
        "server": "pandastack-local",
        "isolation": manager.backend.name,
        "isolation_detail": f"{manager.backend.describe()}; {manager.cgroups.summary()}",
    }
