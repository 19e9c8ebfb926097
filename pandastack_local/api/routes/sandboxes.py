"""Sandboxes: create, list, get, delete."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pandastack_local.limits import MAX_TTL_SECONDS
from pandastack_local.manager import DEFAULT_TTL_SECONDS, ApiError

from .deps import Manager, SandboxDep, bool_field, check_text, int_field, json_body
from .templates import DEFAULT_TEMPLATE, template_name
from .unsupported import refuse_create_fields

router = APIRouter(prefix="/v1/sandboxes")


@router.post("")
async def create_sandbox(request: Request, manager: Manager) -> JSONResponse:
    body = await json_body(request, required=False)
    name = template_name(body.get("template", DEFAULT_TEMPLATE))
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ApiError(400, "metadata must be a map of string to string")
    for key, value in metadata.items():
        check_text(key, "metadata key")
        check_text(value, f"metadata[{key!r}]")
    ttl = int_field(body, "ttl_seconds", minimum=0, maximum=MAX_TTL_SECONDS)
    persistent = bool_field(body, "persistent")
    refuse_create_fields(body)
    template = manager.template(name)
    sb = await manager.create(template, metadata, ttl or DEFAULT_TTL_SECONDS, persistent)
    return JSONResponse(sb.to_json(), status_code=201)


@router.get("")
async def list_sandboxes(manager: Manager) -> JSONResponse:
    return JSONResponse([sb.to_json() for sb in manager.sandboxes.values()])


@router.get("/{sandbox_id}")
async def get_sandbox(sb: SandboxDep) -> JSONResponse:
    return JSONResponse(sb.to_json())


@router.delete("/{sandbox_id}")
async def delete_sandbox(sandbox_id: str, manager: Manager) -> Response:
    await manager.delete(sandbox_id)
    return Response(status_code=204)
