"""Answers for requests that are plainly meant for another tool on this host.

A newcomer who starts pandastack-local on Airflow's port (or points a tool at ours) otherwise
sees a bare ``{"error": "not found"}`` deep inside the other tool's logs. These prefixes are never
PandaStack's (its API is ``/v1``), so the answer names the tool the request was for and the fix.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pandastack_local.api.routes.deps import error
from pandastack_local.config import DEFAULT_PORT

# (path prefix, what sends it): longest prefix first.
FOREIGN_PREFIXES: tuple[tuple[str, str], ...] = (
    ("/execution", "Airflow's Execution API (the Task SDK of a task try)"),
    ("/api/v2", "Airflow's REST API"),
    ("/api/v1", "Airflow 2's REST API"),
    ("/auth", "Airflow's api-server"),
    ("/api", "the Prefect API"),
)
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]

router = APIRouter()


def misdirected(path: str) -> JSONResponse | None:
    """421 naming the intended tool for a path under a foreign prefix, else None."""
    for prefix, sender in FOREIGN_PREFIXES:
        if path == prefix or path.startswith(prefix + "/"):
            return error(
                421,
                f"this is pandastack-local (a PandaStack-compatible server, API under /v1), not {sender}: "
                f"{path} was sent to the wrong port. Run pandastack-local on its own port "
                f"(default {DEFAULT_PORT}: `pandastack-local serve --port {DEFAULT_PORT}`) and point the "
                "other tool at its own server.",
                path=path,
            )
    return None


async def foreign(request: Request) -> JSONResponse:
    answer = misdirected(request.url.path)
    return answer if answer is not None else error(404, "not found")


for _prefix in ("/execution", "/api", "/auth"):
    for _route in (_prefix, _prefix + "/{rest:path}"):
        router.add_api_route(_route, foreign, methods=METHODS, include_in_schema=False)
