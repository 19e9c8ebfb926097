"""Issue 12: bad input to every route gets a JSON error with a 4xx status that names the
field, never a 500 or a stall.

The routes are read from the server's own routers, so a route added later is walked too:
every route gets the generic bad inputs (wrong key, unknown ids, garbage and hostile
bodies, hostile ``?path=``) and must answer each with JSON, below 500, at once. The routes
whose body fields are known get each field's wrong values and must answer 400 naming it.
Each route is walked on a sandbox of its own (a garbage body to DELETE may still delete).
The routes of the not-supported table (``api/routes/unsupported.py``) must answer every one of
those requests with their 501 "... is not supported by pandastack-local", at once.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pandastack
import pytest
from fastapi.routing import APIRoute

from pandastack_local import LocalServer
from pandastack_local.api.routes import ROUTERS
from pandastack_local.api.routes.unsupported import SUFFIX, UNSUPPORTED
from pandastack_local.limits import MAX_JSON_BODY_BYTES

from .bounds_support import http_fixture, server_fixture  # noqa: F401

STALL = 2.0  # seconds: every bad request is answered faster than this
UNKNOWN_ID = "00000000-0000-4000-8000-000000000000"

ROUTES = sorted(
    (method, route.path)
    for router in ROUTERS
    for route in router.routes
    if isinstance(route, APIRoute)
    for method in route.methods
)

GARBAGE_BODIES = {
    "malformed": b"{not json",
    "array": b"[1, 2]",
    "string": b'"cmd"',
    "not-utf8": b"\xff\xfe\xfd",
    "nested": b"[" * 50_000 + b"]" * 50_000,
    "nested-field": b'{"cmd": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    "huge": b'{"pad": "' + b"x" * (MAX_JSON_BODY_BYTES + 1) + b'"}',
}
BAD_PATHS = ["", "relative/x", "/a/../../etc/passwd", "/tmp/\x00x"]

# Known body fields: wrong values that must be a 400 naming the field.
FIELDS: dict[tuple[str, str], dict[str, list[Any]]] = {
    ("POST", "/v1/sandboxes"): {
        "template": [5, "", "../etc", "x" * 65],
        "metadata": ["x", [1], {"k": 1}],
        "ttl_seconds": ["60", -1, True, 1.5],
        "persistent": ["yes", 1],
    },
    ("POST", "/v1/sandboxes/{sandbox_id}/exec"): {
        # A whitespace-only cmd runs, as on the real server (tests/conformance/test_wire_parity).
        "cmd": [None, 5, "", "a\x00b", "x" * (128 * 1024)],
        "timeout_seconds": ["5", -1, 2.5, False],
    },
    ("PATCH", "/v1/sandboxes/{sandbox_id}/lifecycle"): {
        "ttl_seconds": ["60", -5, 1.5],
        "persistent": ["true", 0],
    },
    ("POST", "/v1/sandboxes/{sandbox_id}/fork"): {"count": ["2", -1, 17, 1.5]},
    ("POST", "/v1/sandboxes/{sandbox_id}/fork-tree"): {"count": ["2", -1, 17]},
    ("POST", "/v1/sandboxes/{sandbox_id}/repl/sessions"): {"language": [5, "ruby"]},
    ("POST", "/v1/sandboxes/{sandbox_id}/repl"): {
        "language": [5, "cobol"],
        "code": [5, ["x"], "a\n__FCS_EOF__\nid", "x" * (128 * 1024)],
    },
    ("POST", "/v1/sandboxes/{sandbox_id}/repl/sessions/{context_id}/run"): {
        "code": [None, 5, ""],
        "timeout_ms": ["5", -1, 1.5, 10**12],
    },
}
FIELDS[("POST", "/v1/sandboxes/{sandbox_id}/exec/stream")] = FIELDS[
    ("POST", "/v1/sandboxes/{sandbox_id}/exec")
]
# Routes that change the sandbox whatever the body says (DELETE fs?path=/tmp removes /tmp).
DESTRUCTIVE = {
    ("DELETE", "/v1/sandboxes/{sandbox_id}"),
    ("DELETE", "/v1/sandboxes/{sandbox_id}/fs"),
    ("POST", "/v1/sandboxes/{sandbox_id}/pause"),
}
NOT_SUPPORTED = {route for _, routes in UNSUPPORTED for route in routes}
QUERY_PATH_ROUTES = {(m, p) for m, p in ROUTES if p.endswith("/fs") or "/fs/" in p}


@pytest.fixture(scope="module")
def shared_id(security_server: LocalServer) -> Iterator[str]:
    """One sandbox for the routes a bad request cannot change."""
    c = security_server.client()
    sid = c.sandboxes.create(template="base").id
    yield sid
    with contextlib.suppress(pandastack.NotFoundError):
        c.sandboxes.delete(sid)


def fill(path: str, sandbox_id: str) -> str:
    """The path with the sandbox id in, and any other parameter an id that does not exist."""
    return re.sub(r"\{[^}]+\}", "no-such-thing", path.replace("{sandbox_id}", sandbox_id))


def answered(r: httpx.Response, started: float, what: str, not_supported: bool = False) -> dict[str, Any]:
    elapsed = time.monotonic() - started
    assert elapsed < STALL, f"{what}: took {elapsed:.1f}s"
    if not_supported:
        assert r.status_code == 501 and r.json()["error"].endswith(SUFFIX), f"{what}: {r.text[:300]}"
    else:
        assert r.status_code < 500, f"{what}: {r.status_code} {r.text[:300]}"
    if r.status_code >= 400:
        assert r.headers.get("content-type", "").startswith("application/json"), f"{what}: {r.text[:200]}"
        body = r.json()
        assert isinstance(body, dict) and isinstance(body.get("error"), str) and body["error"], what
        return body
    return {}


def send(
    http: httpx.Client, method: str, url: str, what: str, not_supported: bool = False, **kwargs: Any
) -> tuple[int, dict[str, Any]]:
    started = time.monotonic()
    r = http.request(method, url, **kwargs)
    return r.status_code, answered(r, started, what, not_supported)


def test_the_walk_covers_the_wire_api() -> None:
    """A guard on the walker itself: it sees the routes the SDK uses."""
    for route in [
        ("POST", "/v1/sandboxes"),
        ("POST", "/v1/sandboxes/{sandbox_id}/exec"),
        ("PUT", "/v1/sandboxes/{sandbox_id}/fs"),
        ("PATCH", "/v1/sandboxes/{sandbox_id}/lifecycle"),
        ("POST", "/v1/sandboxes/{sandbox_id}/fork-tree"),
    ]:
        assert route in ROUTES
    assert set(FIELDS) <= set(ROUTES)


@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_every_route_answers_bad_input_with_a_json_4xx(
    server: LocalServer, shared_id: str, http: httpx.Client, method: str, path: str
) -> None:
    client = server.client()
    try:
        walk(server, client, shared_id, http, method, path)
    finally:  # whatever the walk made (a fork child, a sandbox of its own) goes, the shared one stays
        for sb in client.sandboxes.list():
            if sb.id != shared_id:
                client.sandboxes.delete(sb.id)


def walk(
    server: LocalServer, client: Any, shared_id: str, http: httpx.Client, method: str, path: str
) -> None:
    url = fill(path, UNKNOWN_ID)
    if path.startswith("/v1"):
        r = httpx.request(method, server.url + url, headers={"Authorization": "Bearer pds_" + "0" * 32})
        assert r.status_code == 401 and "unauthorized" in r.json()["error"]
    if (method, path) in NOT_SUPPORTED:
        walk_not_supported(http, method, path, shared_id)
        return
    if "{sandbox_id}" in path:
        status, body = send(
            http, method, url, "unknown sandbox", params={"path": "/tmp/x"}, json={"cmd": "true"}
        )
        assert (status, body["error"]) == (404, "not found")

    url = fill(path, UNKNOWN_ID)
    if "{sandbox_id}" in path:
        # A garbage body to a route that acts may still act: those get a sandbox of their own.
        own = (method, path) in DESTRUCTIVE
        url = fill(path, client.sandboxes.create(template="base").id if own else shared_id)
    for name, body_bytes in GARBAGE_BODIES.items():
        status, body = send(http, method, url, f"{name} body", params={"path": "/tmp"}, content=body_bytes)
        if (method, path) in FIELDS:  # a route that reads a JSON body
            expected = 413 if name == "huge" else 400
            assert status == expected, (name, status, body)
            assert ("JSON" in body["error"]) or ("too large" in body["error"]), body
    for bad in BAD_PATHS:
        status, body = send(http, method, url, f"path {bad!r}", params={"path": bad}, content=b"[]")
        if bad == "" and path.endswith("/fs/dir"):
            assert status == 200, (bad, status, body)  # no path lists /, as on the real server
        elif (method, path) in QUERY_PATH_ROUTES:
            assert status == 400 and "path" in body["error"], (bad, status, body)
    for field, values in FIELDS.get((method, path), {}).items():
        for value in values:
            payload = {"cmd": "true", field: value}
            status, body = send(http, method, url, f"{field}={value!r:.40}", json=payload)
            assert status == 400, (field, value, status, body)
            assert field in body["error"], body


def walk_not_supported(http: httpx.Client, method: str, path: str, shared_id: str) -> None:
    """A route of the not-supported table: whatever comes, the same clear 501, never a 404."""
    url = fill(path, shared_id)
    for name, body_bytes in GARBAGE_BODIES.items():
        send(http, method, url, f"{name} body", True, params={"path": "/tmp"}, content=body_bytes)
    for bad in BAD_PATHS:
        send(http, method, url, f"path {bad!r}", True, params={"path": bad}, content=b"[]")
    send(http, method, fill(path, UNKNOWN_ID), "unknown ids", True, json={"cmd": "true"})
