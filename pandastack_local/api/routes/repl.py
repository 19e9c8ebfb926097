"""The one-shot REPL: ``POST /v1/sandboxes/{id}/repl`` and ``GET /v1/repl/languages``, as the
real server's agent answers them (``agent/internal/api/repl.go``).

A snippet runs once in a fresh interpreter (no state kept: code contexts keep state), through
the same capped exec as ``POST .../exec``: the code is fed to the interpreter by a quoted
heredoc, as the real server does, so a snippet is data to the shell, never expanded by it.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pandastack_local.manager import ApiError

from .deps import Manager, SandboxDep, json_body
from .exec import CLIENT_CLOSED, check_command, run_capped

router = APIRouter()

DELIMITER = "__FCS_EOF__"
# The real server's table: language -> interpreter reading the snippet from stdin.
INTERPRETERS = {
    "python": "python3 -",
    "py": "python3 -",
    "node": "node -",
    "js": "node -",
    "bash": "bash",
    "sh": "sh",
    "ruby": "ruby -",
}


def snippet_command(body: dict[str, object]) -> tuple[str, str]:
    """(language, shell command) for a one-shot body, or a 400 naming the field."""
    language = body.get("language", "")
    if not isinstance(language, str):
        raise ApiError(400, f"language must be a string, one of {', '.join(INTERPRETERS)}")
    language = language.strip().lower() or "python"
    if language not in INTERPRETERS:
        raise ApiError(400, f"unsupported language: {language[:40]} (one of {', '.join(INTERPRETERS)})")
    code = body.get("code", "")
    if not isinstance(code, str):
        raise ApiError(400, 'code must be a string: give the snippet to run as "code"')
    if DELIMITER in code:
        raise ApiError(400, f"code may not contain {DELIMITER} delimiter")
    cmd = f"{INTERPRETERS[language]} <<'{DELIMITER}'\n{code}\n{DELIMITER}\n"
    check_command(cmd, "code")
    return language, cmd


@router.post("/v1/sandboxes/{sandbox_id}/repl")
async def run_snippet(request: Request, manager: Manager, sb: SandboxDep) -> Response:
    language, cmd = snippet_command(await json_body(request))
    manager.running(sb.id)
    sb.log(f"repl ({language}): {len(cmd)} characters")
    started = time.monotonic()
    ran = await run_capped(request, manager, sb, {"op": "exec", "cmd": cmd, "timeout_seconds": 0})
    if ran is None:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(
        {
            "language": language,
            "stdout": ran.stdout,
            "stderr": ran.stderr,
            "exit_code": ran.exit_code,
            "duration_ms": int((time.monotonic() - started) * 1000),
        }
    )


@router.get("/v1/repl/languages")
async def languages() -> JSONResponse:
    return JSONResponse(sorted(INTERPRETERS))
