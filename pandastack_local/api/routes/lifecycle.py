"""Lifecycle: TTL and persistence, pause/resume, logs, and fork (a child is a copy of the
parent's disk)."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from pandastack_local.limits import MAX_TTL_SECONDS
from pandastack_local.manager import MAX_FORK_COUNT, ApiError, Sandbox, SandboxManager, rfc3339

from .deps import Manager, SandboxDep, bool_field, int_field, json_body

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}")


@router.get("/lifecycle")
async def get_lifecycle(manager: Manager, sb: SandboxDep) -> JSONResponse:
    return JSONResponse(manager.lifecycle(sb))


@router.patch("/lifecycle")
async def patch_lifecycle(request: Request, manager: Manager, sb: SandboxDep) -> JSONResponse:
    body = await json_body(request)
    ttl = int_field(body, "ttl_seconds", minimum=0, maximum=MAX_TTL_SECONDS)
    if ttl == 0:  # the TTL is the backstop: only an explicit persistent: true goes without one
        raise ApiError(
            400,
            "ttl_seconds must be at least 1: to keep a sandbox without an idle TTL, set persistent: true",
        )
    if ttl is not None:
        sb.ttl_seconds = ttl
    if "persistent" in body:
        sb.persistent = bool_field(body, "persistent")
    with manager.activity(sb):
        pass
    return JSONResponse(manager.lifecycle(sb))


@router.post("/pause")
async def pause(manager: Manager, sb: SandboxDep) -> Response:
    if sb.status != "paused":
        await manager.pause(sb, True)
    return Response(status_code=204)


@router.post("/resume")
async def resume(manager: Manager, sb: SandboxDep) -> Response:
    if sb.status == "paused":
        await manager.pause(sb, False)
    with manager.activity(sb):
        pass
    return Response(status_code=204)


@router.get("/logs")
async def logs(sb: SandboxDep) -> PlainTextResponse:
    return PlainTextResponse("\n".join(sb.logs) + "\n")


async def fork_children(
    request: Request, manager: SandboxManager, parent: Sandbox, default_count: int
) -> list[Sandbox]:
    body = await json_body(request, required=False)
    count = int_field(body, "count", default_count)
    require_memory = bool_field(body, "require_memory")
    if count is None or not 1 <= count <= MAX_FORK_COUNT:  # 0 is no fork, not the default one
        raise ApiError(400, f"count must be between 1 and {MAX_FORK_COUNT}: got {count}")
    if parent.status != "running" or not parent.process.alive() or parent.ended:
        raise ApiError(500, "parent sandbox not found or not running")
    # Held: a fork waits on the server (children starting, a checkpoint), each step with a deadline.
    with manager.activity(parent, hold=True):
        return await manager.fork(parent, count, require_memory)


def memory_note(manager: SandboxManager, children: list[Sandbox]) -> dict[str, object]:
    """Whether the fork copied the parent's memory, and why not when it did not (never silent)."""
    if all(c.memory_copied for c in children):
        return {"memory_copied": True}
    return {"memory_copied": False, "why": manager.backend.no_memory_fork}


@router.post("/fork")
async def fork(request: Request, manager: Manager, parent: SandboxDep) -> JSONResponse:
    children = await fork_children(request, manager, parent, 1)
    return JSONResponse(
        {
            "parent_id": parent.id,
            "snapshot_id": f"snap-{uuid.uuid4()}",
            "children": [c.id for c in children],
            "at": rfc3339(time.time()),
            **memory_note(manager, children),
        },
        status_code=201,
    )


@router.post("/fork-tree")
async def fork_tree(request: Request, manager: Manager, parent: SandboxDep) -> JSONResponse:
    children = await fork_children(request, manager, parent, 2)
    return JSONResponse(
        {
            "tree_id": str(uuid.uuid4()),
            "parent_id": parent.id,
            "snapshot_id": f"snap-{uuid.uuid4()}",
            "children": [c.to_json() for c in children],
            **memory_note(manager, children),
        },
        status_code=201,
    )
