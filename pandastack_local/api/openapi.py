"""The served ``/openapi.json``: every route as it behaves.

The routes parse their bodies by hand (malformed JSON is a 400 naming the problem, not FastAPI's
422), so FastAPI alone would describe no request body and no status but 200/422. ``OPERATIONS``
says, per route, its body, its query parameters and every status it answers with the error
envelope; ``describe`` lays that over FastAPI's paths. A test walks the app's routes and checks
each route's documented codes against the codes its code can answer
(tests/local/test_service.py); the fuzz leg (tests/fuzz) holds the server to it.

Where a code is there for parity with PandaStack (a 500 the real server sends for a client's
mistake or a missing thing), its description says so (docs/local-server.md, "Differences").
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pandastack_local import __version__
from pandastack_local.limits import (
    BODY_IDLE_SECONDS,
    MAX_COMMAND_BYTES,
    MAX_EXEC_TIMEOUT_SECONDS,
    MAX_TTL_SECONDS,
)

ERROR = {"$ref": "#/components/schemas/Error"}
INT = {"type": "integer"}
STR = {"type": "string"}
BOOL = {"type": "boolean"}
BINARY = {"type": "string", "format": "binary"}


def obj(required: list[str], **props: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": props}


SANDBOX = obj(
    ["id", "template", "cpu", "memory_mb", "status", "created_at", "metadata", "persistent"],
    id=STR,
    template=STR,
    cpu=INT,
    memory_mb=INT,
    status={"enum": ["creating", "running", "paused", "stopping", "deleted", "failed", "hibernated"]},
    guest_ip={"type": ["string", "null"]},
    boot_ms=INT,
    boot_mode=STR,
    created_at=STR,
    metadata={"type": "object", "additionalProperties": STR},
    from_snapshot={"type": ["string", "null"]},
    persistent=BOOL,
    isolation=STR,
    memory_copied={"type": ["boolean", "null"]},
)
SCHEMAS: dict[str, Any] = {
    "Error": obj(["error"], error=STR, detail=STR),
    "Sandbox": SANDBOX,
    "Lifecycle": obj(
        ["ttl_seconds", "persistent", "idle_seconds"], ttl_seconds=INT, persistent=BOOL, idle_seconds=INT
    ),
    "ExecResult": obj(
        ["stdout", "stderr", "exit_code"],
        stdout=STR,
        stderr=STR,
        exit_code=INT,
        duration_ms=INT,
        truncated=BOOL,
        stdout_dropped_bytes=INT,
        stderr_dropped_bytes=INT,
    ),
    "FsEntry": obj(
        ["name", "is_dir", "size", "mode", "mtime"], name=STR, is_dir=BOOL, size=INT, mode=STR, mtime=INT
    ),
}
ENTRY = {"$ref": "#/components/schemas/FsEntry"}
LIFECYCLE = {"$ref": "#/components/schemas/Lifecycle"}
# Code contexts' answers: a context, a cell's run, a one-shot snippet's run.
CONTEXT = obj(
    ["id", "sandbox_id", "language", "created_at"], id=STR, sandbox_id=STR, language=STR, created_at=STR
)
CELL = obj(
    ["stdout", "stderr", "exit"],
    stdout=STR,
    stderr=STR,
    exit=INT,
    results={"type": "array"},
    error={"type": ["string", "null"]},
    duration_ms=INT,
)
SNIPPET = obj(
    ["language", "stdout", "stderr", "exit_code"],
    language=STR,
    stdout=STR,
    stderr=STR,
    exit_code=INT,
    duration_ms=INT,
)
# Request bodies, as JSON Schema: what the route accepts (other fields are ignored).
NO_NUL = "^[^\\u0000]*$"
BODIES: dict[str, dict[str, Any]] = {
    "create": {
        "type": "object",
        "properties": {
            "template": {"type": "string", "pattern": "^[A-Za-z0-9._-]{1,64}$"},
            "metadata": {"type": "object", "additionalProperties": STR},
            "ttl_seconds": {"type": "integer", "minimum": 0, "maximum": MAX_TTL_SECONDS},
            "persistent": BOOL,
        },
    },
    "exec": {
        "type": "object",
        "required": ["cmd"],
        "properties": {
            "cmd": {"type": "string", "minLength": 1, "maxLength": MAX_COMMAND_BYTES // 4, "pattern": NO_NUL},
            "timeout_seconds": {"type": "integer", "minimum": 0, "maximum": MAX_EXEC_TIMEOUT_SECONDS},
        },
    },
    "lifecycle": {
        "type": "object",
        "properties": {
            "ttl_seconds": {"type": "integer", "minimum": 1, "maximum": MAX_TTL_SECONDS},
            "persistent": BOOL,
        },
    },
    "fork": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": 1, "maximum": 16},
            # true: refuse (409) a fork that would copy the disk only (bwrap) instead of making it.
            "require_memory": BOOL,
        },
    },
    "context": {"type": "object", "properties": {"language": {"enum": ["python", "py", "python3"]}}},
    "run": {
        "type": "object",
        "required": ["code"],
        "properties": {
            "code": {"type": "string", "minLength": 1},
            "timeout_ms": {"type": "integer", "minimum": 0, "maximum": 24 * 3600 * 1000},
        },
    },
    "snippet": {
        "type": "object",
        "properties": {
            "language": {"enum": ["python", "py", "node", "js", "bash", "sh", "ruby"]},
            "code": {"type": "string", "maxLength": MAX_COMMAND_BYTES // 4 - 64, "pattern": NO_NUL},
        },
    },
}

REQUIRED_BODIES = {"exec", "lifecycle", "run", "snippet"}

# Statuses and what each means, by route kind. "P" marks parity with PandaStack.
AUTH = {401: "missing or invalid bearer token (`{error, detail}`)"}
SANDBOX_404 = {404: "no such sandbox (`not found`)"}
BAD_JSON = {400: "malformed JSON, or a field of the wrong type or range (the message names it)"}
TOO_LARGE = {413: "the body is over its cap (limits.py)"}
AGENT_500 = {
    500: "the sandbox is not running (its processes exited, or its agent went away mid-request); "
    "PandaStack answers these 500 too"
}
PAUSED = {409: "the sandbox is paused"}
EXEC_429 = {429: "the sandbox runs as many execs as its template allows (Retry-After)"}
CAPACITY_503 = {503: "no capacity now (Retry-After): sandboxes, or a template still being built"}
MEMORY_507 = {507: "the memory budget is spent (Retry-After)"}
# limits.StreamBudget: exec/stream, GET fs and PUT fs hold part of it while they run.
TRANSFER_503 = {503: "the server's budget for slow readers and uploads is spent (Retry-After)"}


def op(
    summary: str,
    ok: tuple[int, str, Any],
    *codes: dict[int, str],
    body: str | None = None,
    query: list[dict[str, Any]] | None = None,
    raw_body: bool = False,
) -> dict[str, Any]:
    """One operation: its success (status, description, schema or None) and its error codes."""
    status, description, schema = ok
    success: dict[str, Any] = {"description": description}
    if isinstance(schema, dict) and schema.get("media"):
        success["content"] = {schema["media"]: {"schema": schema.get("schema", {})}}
    elif schema is not None:
        success["content"] = {"application/json": {"schema": schema}}
    responses: dict[str, Any] = {str(status): success}
    for table in codes:
        for code, text in table.items():
            responses[str(code)] = {"description": text, "content": {"application/json": {"schema": ERROR}}}
            if code in (429, 503, 507):
                responses[str(code)]["headers"] = {"Retry-After": {"schema": INT, "description": "seconds"}}
    out: dict[str, Any] = {"summary": summary, "responses": responses}
    if body is not None:  # a body the route reads with json_body(): required unless it may be empty
        required = body in REQUIRED_BODIES
        out["requestBody"] = {"required": required, "content": {"application/json": {"schema": BODIES[body]}}}
    if raw_body:
        out["requestBody"] = {
            "required": True,
            "content": {"application/octet-stream": {"schema": BINARY}},
        }
    if "requestBody" in out:  # deps.read_body: a body that sends nothing for a while
        responses["408"] = {
            "description": f"the request body stalled: no byte of it for {BODY_IDLE_SECONDS:g} s",
            "content": {"application/json": {"schema": ERROR}},
        }
    if query:
        out["parameters"] = query
    return out


def sandbox_op(
    summary: str,
    ok: tuple[int, str, Any],
    *codes: dict[int, str],
    not_found: dict[int, str] = SANDBOX_404,
    **kw: Any,
) -> dict[str, Any]:
    """A route of one sandbox: 401 and 404 (no such sandbox, or what ``not_found`` says) come first."""
    return op(summary, ok, AUTH, not_found, *codes, **kw)


def fs_op(
    summary: str, ok: tuple[int, str, Any], *codes: dict[int, str], required: bool = True, **kw: Any
) -> dict[str, Any]:
    """A file-system route: a sandbox's, with the ``path`` query parameter."""
    return sandbox_op(summary, ok, *codes, query=path_param(required), **kw)


def fork_op(summary: str, description: str, schema: dict[str, Any], not_running: str) -> dict[str, Any]:
    """A fork route: fork and fork-tree differ only in what they answer with."""
    return sandbox_op(
        summary,
        (201, description, schema),
        BAD_JSON,
        TOO_LARGE,
        {409: "the parent's disk is over the fork copy cap, it is busy, or require_memory under bwrap"},
        {500: not_running},
        CAPACITY_503,
        MEMORY_507,
        body="fork",
    )


def array(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


def path_param(required: bool) -> list[dict[str, Any]]:
    return [
        {
            "name": "path",
            "in": "query",
            "required": required,
            "description": "absolute path inside the sandbox, no '..' component, no NUL",
            "schema": {"type": "string", "pattern": "^/[^\\u0000]*$"},
        }
    ]


FS_OS = {
    403: "the OS refused it: permission denied or a read-only file system (EACCES, EPERM, EROFS)",
    409: "the sandbox is paused, the path is a mount point, or it exists, is busy or not empty",
    507: "the sandbox's disk is full",
}
CONTEXT_429 = {429: "the sandbox has as many code contexts as allowed (Retry-After)"}
CONTEXT_404 = {404: "no such sandbox or context"}
PATH_400 = {
    400: "missing, relative or '..' path, a file the read refuses (not regular, over the cap), or another "
    "OS refusal named in the error (ENOTDIR, EIO, ...)"
}
SB = "/v1/sandboxes/{sandbox_id}"
OPERATIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("get", "/healthz"): op(
        "health (no auth)",
        (
            200,
            "ok",
            obj(
                ["status"],
                status=STR,
                sandboxes=INT,
                tearing_down=INT,
                isolation=STR,
                memory={"type": "object", "description": "the memory budget and what its guard did"},
            ),
        ),
    ),
    ("get", "/version"): op(
        "version (no auth)", (200, "the server", obj(["version"], version=STR, server=STR))
    ),
    ("post", "/v1/sandboxes"): op(
        "create a sandbox",
        (201, "created", SANDBOX),
        AUTH,
        BAD_JSON,
        TOO_LARGE,
        {
            500: "unknown template (P: PandaStack's `template ... could not be pulled`), a failed template "
            "build, or the sandbox failed to start"
        },
        {501: "from_snapshot or volumes (not supported here)"},
        CAPACITY_503,
        MEMORY_507,
        body="create",
    ),
    ("get", "/v1/sandboxes"): op("list sandboxes", (200, "a bare array", array(SANDBOX)), AUTH),
    ("get", SB): sandbox_op("get a sandbox", (200, "the sandbox", SANDBOX)),
    ("delete", SB): sandbox_op("delete a sandbox", (204, "deleted", None)),
    ("get", "/v1/templates"): op("list templates", (200, "templates", array({"type": "object"})), AUTH),
    ("get", "/v1/templates/{name}"): op(
        "get a template", (200, "the template", {"type": "object"}), AUTH, {404: "no such template"}
    ),
    ("get", "/v1/me"): op("who the key is", (200, "the key's owner", {"type": "object"}), AUTH),
    ("post", f"{SB}/exec"): sandbox_op(
        "run a command, answered whole",
        (
            200,
            "its output (each stream's first 1 MiB) and exit code",
            {"$ref": "#/components/schemas/ExecResult"},
        ),
        BAD_JSON,
        TOO_LARGE,
        PAUSED,
        EXEC_429,
        {499: "the client went away before the answer (nobody reads this)"},
        {500: "the command's timeout (the text says `timeout`), or the sandbox is not running (P)"},
        body="exec",
    ),
    ("post", f"{SB}/exec/stream"): sandbox_op(
        "run a command, streamed (SSE)",
        (
            200,
            "events: stdout/stderr {chunk}, then exit {exit_code} or error {error}",
            {"media": "text/event-stream", "schema": {"type": "object"}},
        ),
        BAD_JSON,
        TOO_LARGE,
        PAUSED,
        EXEC_429,
        AGENT_500,
        TRANSFER_503,
        body="exec",
    ),
    ("get", f"{SB}/fs"): fs_op(
        "read a file",
        (
            200,
            "its bytes",
            {"media": "application/octet-stream", "schema": BINARY},
        ),
        PATH_400,
        FS_OS,
        {500: "no such file (P: PandaStack's 500 `No such file or directory`), or another OS error"},
        TRANSFER_503,
    ),
    ("put", f"{SB}/fs"): fs_op(
        "write a file (parents created)",
        (200, "written", obj(["path", "bytes"], path=STR, bytes=INT)),
        PATH_400,
        TOO_LARGE,
        PAUSED,
        AGENT_500,
        FS_OS,
        TRANSFER_503,
        raw_body=True,
    ),
    ("get", f"{SB}/fs/dir"): fs_op(
        "list a directory (no path: /)",
        (200, "its entries", obj(["path", "entries"], path=STR, entries=array(ENTRY))),
        PATH_400,
        FS_OS,
        AGENT_500,
        required=False,
    ),
    ("get", f"{SB}/fs/stat"): fs_op(
        "stat a path (follows a symlink)",
        (200, "one entry", ENTRY),
        PATH_400,
        FS_OS,
        AGENT_500,
        not_found={404: "no such sandbox, or no such file (`file does not exist`)"},
    ),
    ("delete", f"{SB}/fs"): fs_op(
        "delete a path",
        (204, "deleted", None),
        {400: "missing or relative path, or the sandbox's root"},
        PAUSED,
        AGENT_500,
        FS_OS,
    ),
    ("get", f"{SB}/lifecycle"): sandbox_op("TTL and persistence", (200, "now", LIFECYCLE)),
    ("patch", f"{SB}/lifecycle"): sandbox_op(
        "set the idle TTL (at least 1 s) or persistence",
        (200, "now", LIFECYCLE),
        {400: "malformed JSON, a field of the wrong type, or ttl_seconds 0 (set persistent)"},
        TOO_LARGE,
        body="lifecycle",
    ),
    ("post", f"{SB}/pause"): sandbox_op("pause", (204, "paused", None), AGENT_500),
    ("post", f"{SB}/resume"): sandbox_op("resume", (204, "running", None), AGENT_500),
    ("get", f"{SB}/logs"): sandbox_op(
        "the sandbox log", (200, "text", {"media": "text/plain", "schema": STR})
    ),
    ("post", f"{SB}/fork"): fork_op(
        "fork (bwrap: a cold fork, the disk copied, memory_copied false and why; gVisor: memory too)",
        "the children's ids",
        obj(
            ["parent_id", "children"],
            parent_id=STR,
            snapshot_id=STR,
            children=array(STR),
            at=STR,
            memory_copied=BOOL,
            why=STR,
        ),
        "the parent is not running (P: `parent sandbox not found or not running`), or the fork failed",
    ),
    ("post", f"{SB}/fork-tree"): fork_op(
        "fork into count children (default 2)",
        "the children",
        obj(
            ["parent_id", "children"],
            tree_id=STR,
            parent_id=STR,
            snapshot_id=STR,
            children=array(SANDBOX),
            memory_copied=BOOL,
            why=STR,
        ),
        "the parent is not running (P), or the fork failed",
    ),
    ("post", f"{SB}/repl/sessions"): sandbox_op(
        "open a code context (python)",
        (201, "the context", CONTEXT),
        BAD_JSON,
        TOO_LARGE,
        PAUSED,
        {429: "the sandbox has as many contexts as allowed (Retry-After)"},
        AGENT_500,
        body="context",
    ),
    ("get", f"{SB}/repl/sessions"): sandbox_op(
        "list code contexts",
        (200, "contexts", array({"type": "object"})),
        PAUSED,
        CONTEXT_429,
        AGENT_500,
    ),
    ("delete", f"{SB}/repl/sessions/{{context_id}}"): sandbox_op(
        "close a code context",
        (204, "closed", None),
        PAUSED,
        CONTEXT_429,
        AGENT_500,
        not_found=CONTEXT_404,
    ),
    ("post", f"{SB}/repl/sessions/{{context_id}}/run"): sandbox_op(
        "run code in a context",
        (200, "its output and results", CELL),
        BAD_JSON,
        TOO_LARGE,
        PAUSED,
        EXEC_429,
        {499: "the client went away before the answer: the cell is interrupted (nobody reads this)"},
        {
            500: "cell timeout (P: PandaStack's 500 `cell timeout`), the context died, or the sandbox "
            "is not running"
        },
        body="run",
        not_found=CONTEXT_404,
    ),
    ("post", f"{SB}/repl"): sandbox_op(
        "run a snippet once (fresh interpreter)",
        (200, "its output", SNIPPET),
        {
            400: "malformed JSON, an unsupported language, or code holding the heredoc delimiter (as "
            "on PandaStack)"
        },
        TOO_LARGE,
        PAUSED,
        EXEC_429,
        {499: "the client went away before the answer"},
        AGENT_500,
        body="snippet",
    ),
    ("get", "/v1/repl/languages"): op("one-shot languages", (200, "names", array(STR)), AUTH),
}
# Every route also answers these, before any route code runs (api/connections.py).
CONNECTION = {
    "408": "the request's headers did not arrive within the header timeout",
    "429": "too many connections from this client address (Retry-After)",
    "431": "the request's headers are over 16 KiB",
    "503": "too many connections (Retry-After)",
}


def describe(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document (paths, path parameters) with OPERATIONS laid over it."""
    doc = get_openapi(
        title="pandastack-local", version=__version__, routes=app.routes, openapi_version="3.1.0"
    )
    doc["info"]["description"] = (
        'A PandaStack-compatible server. Every error is `{"error": ...}`. Every route may also '
        "answer: " + "; ".join(f"{k} {v}" for k, v in CONNECTION.items()) + "."
    )
    doc.setdefault("components", {})["schemas"] = SCHEMAS
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, methods in doc["paths"].items():
        for method, operation in methods.items():
            spec = OPERATIONS.get((method, path))
            if spec is None:
                raise RuntimeError(f"{method.upper()} {path} is not described in api/openapi.py")
            params = [p for p in operation.get("parameters", []) if p.get("in") == "path"]
            operation.clear()
            operation.update(spec)
            operation["parameters"] = params + spec.get("parameters", [])
            if path.startswith("/v1"):
                operation["security"] = [{"bearer": []}]
    return doc


def install(app: FastAPI) -> None:
    """Serve ``describe(app)`` at /openapi.json (built once)."""
    cache: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if not cache:
            cache.update(_this_server(describe(app), app))
        return cache

    app.openapi = openapi  # type: ignore[method-assign]


def _this_server(doc: dict[str, Any], app: FastAPI) -> dict[str, Any]:
    """What depends on this server's flags: a fork's ``count`` is at most ``--max-sandboxes``
    (more can never be admitted: a 400), so the document says so."""
    manager = getattr(app.state, "manager", None)
    limit = getattr(getattr(manager, "config", None), "max_sandboxes", None)
    if not limit:
        return doc
    fork = copy.deepcopy(BODIES["fork"])
    fork["properties"]["count"]["maximum"] = min(fork["properties"]["count"]["maximum"], limit)
    for operations in doc["paths"].values():
        for operation in operations.values():
            content = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
            if content.get("schema") is BODIES["fork"]:
                content["schema"] = fork
    return doc
