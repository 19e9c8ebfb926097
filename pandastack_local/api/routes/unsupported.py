"""Every route the ``pandastack`` SDK (0.10.0) can send that this server does not implement,
answered with the real server's error envelope and HTTP 501: ``{"error": "<what> (METHOD
/v1/...) is not supported by pandastack-local"}``.

Without this table such a request would fall through to a bare 404 ``not found``, which the
SDK raises as ``NotFoundError`` and reads like "no such sandbox". 501 is what the SDK raises
as ``pandastack.ServerError`` with this message; it is never retried (not a capacity answer,
no transient phrase). One table, mounted after the real routes (``ROUTERS``), so a route
implemented later wins as soon as it is registered; the tests walk every row.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from pandastack_local.manager import ApiError

from .deps import error

NOT_IMPLEMENTED = 501
SUFFIX = "is not supported by pandastack-local"

# (what, the routes the SDK sends for it). Paths are the SDK's, with the server's prefix.
UNSUPPORTED: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("promoting a forked sandbox", (("POST", "/v1/sandboxes/{sandbox_id}/promote"),)),
    ("memory snapshots", (("POST", "/v1/sandboxes/{sandbox_id}/snapshots"),)),
    ("hibernating a sandbox", (("POST", "/v1/sandboxes/{sandbox_id}/hibernate"),)),
    ("waking a hibernated sandbox", (("POST", "/v1/sandboxes/{sandbox_id}/wake"),)),
    ("ports and preview URLs", (("GET", "/v1/sandboxes/{sandbox_id}/ports"),)),
    (
        "snapshots",
        (
            ("GET", "/v1/snapshots"),
            ("GET", "/v1/snapshots/{snapshot_id}"),
            ("DELETE", "/v1/snapshots/{snapshot_id}"),
        ),
    ),
    (
        "volumes",
        (
            ("POST", "/v1/volumes"),
            ("GET", "/v1/volumes"),
            ("GET", "/v1/volumes/{name}"),
            ("DELETE", "/v1/volumes/{name}"),
        ),
    ),
    (
        "template builds (local templates come from --template-dir)",
        (
            ("POST", "/v1/templates/build"),
            ("GET", "/v1/templates/builds"),
            ("GET", "/v1/templates/builds/{build_id}"),
            ("GET", "/v1/templates/builds/{build_id}/logs"),
            ("DELETE", "/v1/templates/{name}"),
        ),
    ),
    (
        "API tokens (the local server has one key)",
        (("GET", "/v1/me/tokens"), ("POST", "/v1/me/tokens"), ("DELETE", "/v1/me/tokens/{prefix}")),
    ),
    (
        "apps",
        (
            ("POST", "/v1/apps"),
            ("GET", "/v1/apps"),
            ("GET", "/v1/apps/{app_id}"),
            ("PATCH", "/v1/apps/{app_id}"),
            ("DELETE", "/v1/apps/{app_id}"),
            ("POST", "/v1/apps/{app_id}/deploys"),
            ("GET", "/v1/apps/{app_id}/deploys"),
            ("GET", "/v1/apps/{app_id}/deploys/{deployment_id}"),
            ("GET", "/v1/apps/{app_id}/deploys/{deployment_id}/logs"),
            ("POST", "/v1/apps/{app_id}/rollback"),
            ("GET", "/v1/apps/{app_id}/env"),
            ("PUT", "/v1/apps/{app_id}/env/{key}"),
            ("DELETE", "/v1/apps/{app_id}/env/{key}"),
            ("POST", "/v1/apps/{app_id}/env/import"),
            ("POST", "/v1/apps/{app_id}/domains"),
            ("GET", "/v1/apps/{app_id}/domains"),
            ("GET", "/v1/apps/{app_id}/domains/{domain}"),
            ("DELETE", "/v1/apps/{app_id}/domains/{domain}"),
        ),
    ),
    (
        "preview environments",
        (
            ("GET", "/v1/preview-repos"),
            ("POST", "/v1/preview-repos"),
            ("DELETE", "/v1/preview-repos/{github_repo_id}"),
            ("GET", "/v1/repos/{github_repo_id}/preview-env"),
            ("PUT", "/v1/repos/{github_repo_id}/preview-env/{key}"),
            ("DELETE", "/v1/repos/{github_repo_id}/preview-env/{key}"),
            ("POST", "/v1/repos/{github_repo_id}/preview-env/import"),
        ),
    ),
    (
        "databases",
        (
            ("POST", "/v1/databases"),
            ("GET", "/v1/databases"),
            ("GET", "/v1/databases/{database_id}"),
            ("PATCH", "/v1/databases/{database_id}"),
            ("DELETE", "/v1/databases/{database_id}"),
            ("GET", "/v1/databases/{database_id}/connection"),
            ("POST", "/v1/databases/{database_id}/failover"),
            ("POST", "/v1/databases/{database_id}/wake"),
            ("POST", "/v1/databases/{database_id}/clone"),
            ("POST", "/v1/databases/{database_id}/reset-credentials"),
        ),
    ),
    (
        "functions",
        (
            ("POST", "/v1/functions"),
            ("GET", "/v1/functions"),
            ("GET", "/v1/functions/{function_id}"),
            ("PATCH", "/v1/functions/{function_id}"),
            ("DELETE", "/v1/functions/{function_id}"),
            ("POST", "/v1/functions/{function_id}/deploy"),
            ("GET", "/v1/functions/{function_id}/metrics"),
            ("POST", "/v1/functions/{function_id}/invoke"),
            ("GET", "/v1/functions/{function_id}/runs"),
        ),
    ),
    (
        "schedules",
        (
            ("POST", "/v1/schedules"),
            ("GET", "/v1/schedules"),
            ("GET", "/v1/schedules/{schedule_id}"),
            ("PATCH", "/v1/schedules/{schedule_id}"),
            ("DELETE", "/v1/schedules/{schedule_id}"),
            ("POST", "/v1/schedules/{schedule_id}/trigger"),
            ("GET", "/v1/schedules/{schedule_id}/runs"),
        ),
    ),
)

# Static paths a real route's parameter would take first (GET /v1/templates/{name} would answer
# GET /v1/templates/builds with 404): these rows are mounted before the real routes.
SHADOWED = frozenset({("GET", "/v1/templates/builds")})

# Create-body fields the SDK sends for features this server does not have (never ignored).
UNSUPPORTED_CREATE_FIELDS = {"from_snapshot": "creating a sandbox from a snapshot", "volumes": "volumes"}


def message(what: str, method: str, path: str) -> str:
    return f"{what} ({method} {path}) {SUFFIX}"


def refuse_create_fields(body: dict[str, Any]) -> None:
    """A create that asks for a snapshot or volumes is refused, not run without them."""
    for field, what in UNSUPPORTED_CREATE_FIELDS.items():
        if body.get(field) not in (None, [], ""):
            raise ApiError(NOT_IMPLEMENTED, f"{what} ({field}) {SUFFIX}")


def answer(text: str) -> Callable[[], Coroutine[Any, Any, JSONResponse]]:
    async def not_supported() -> JSONResponse:
        return error(NOT_IMPLEMENTED, text)

    return not_supported


def build(shadowed: bool) -> APIRouter:
    router = APIRouter()
    for what, routes in UNSUPPORTED:
        for method, path in routes:
            if ((method, path) in SHADOWED) == shadowed:
                router.add_api_route(
                    path, answer(message(what, method, path)), methods=[method], include_in_schema=False
                )
    return router


router = build(shadowed=False)
shadowed_router = build(shadowed=True)
