"""Templates: the rules for the ``template`` a create request names, the routes that list and
get templates, and ``GET /v1/me``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from pandastack_local.manager import ApiError
from pandastack_local.templates.registry import TEMPLATE_NAME_RE

from .deps import Manager

router = APIRouter(prefix="/v1")

DEFAULT_TEMPLATE = "code-interpreter"


def template_name(value: Any) -> str:
    """A well-formed template name, or 400 (an unknown one is the manager's 500, as on the wire)."""
    if not isinstance(value, str) or not TEMPLATE_NAME_RE.match(value):
        raise ApiError(400, "invalid template name (allowed: [A-Za-z0-9._-], at most 64 chars)")
    return value


def template_json(manager: Any, name: str) -> dict[str, Any]:
    """A template as the real server lists it (name, cpu, memory_mb, size_bytes, meta) plus disk_mb;
    ``meta.build`` says whether its software is ready, building or failed (with why)."""
    out: dict[str, Any] = manager.templates[name].to_json()
    out["rootfs_path"] = ""  # no rootfs image: a sandbox's root is a tmpfs (docs/local-server.md)
    out["meta"]["build"] = manager.builds.state(name)
    if name in manager.builds.errors:
        out["meta"]["build_error"] = manager.builds.errors[name]
    return out


@router.get("/templates")
async def list_templates(manager: Manager) -> JSONResponse:
    return JSONResponse([template_json(manager, name) for name in sorted(manager.templates)])


@router.get("/templates/{name}")
async def get_template(name: str, manager: Manager) -> JSONResponse:
    if name not in manager.templates:
        raise ApiError(404, "not found")
    return JSONResponse(template_json(manager, name))


@router.get("/me")
async def me() -> JSONResponse:
    """Who the key belongs to: the real server's shape for a token (no user, no orgs)."""
    return JSONResponse(
        {"user_id": "local", "email": "", "current_org": None, "orgs": [], "auth_method": "api_key"}
    )
