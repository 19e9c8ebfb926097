"""Every route the SDK can send that pandastack-local does not implement answers with the real
server's envelope and 501 "... is not supported by pandastack-local" (pandastack.ServerError),
never a bare 404 that reads like "no such sandbox"; a truly unknown path still 404s."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import pandastack
import pytest

from pandastack_local.api.routes.unsupported import UNSUPPORTED

ROWS = [(what, method, path) for what, routes in UNSUPPORTED for method, path in routes]
UNKNOWN = "00000000-0000-4000-8000-000000000000"


@pytest.fixture
def sandbox(local_server) -> Iterator[Any]:
    with local_server.client().sandboxes.create(template="base") as sb:
        yield sb


@pytest.mark.parametrize(("what", "method", "path"), ROWS, ids=[f"{m} {p}" for _, m, p in ROWS])
def test_raw_http_gets_501_in_the_error_envelope(
    local_http, sandbox, what: str, method: str, path: str
) -> None:
    url = re.sub(r"\{[^}]+\}", "x1", path.replace("{sandbox_id}", sandbox.id))
    r = local_http.request(method, url, json={})
    assert r.status_code == 501, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    assert r.json() == {"error": f"{what} ({method} {path}) is not supported by pandastack-local"}


SDK_CALLS: dict[str, Callable[[Any, Any], Any]] = {
    "promote": lambda c, sb: sb.promote(cleanup_siblings=True),
    "snapshot": lambda c, sb: sb.snapshot(),
    "hibernate": lambda c, sb: sb.hibernate(),
    "wake": lambda c, sb: sb.wake(),
    "preview_urls": lambda c, sb: sb.preview_urls(),
    "snapshots.list": lambda c, sb: c.snapshots.list(sandbox_id=sb.id),
    "snapshots.get": lambda c, sb: c.snapshots.get("snap-1"),
    "snapshots.delete": lambda c, sb: c.snapshots.delete("snap-1"),
    "volumes.create": lambda c, sb: c.volumes.create("v", 64),
    "volumes.list": lambda c, sb: c.volumes.list(),
    "volumes.get": lambda c, sb: c.volumes.get("v"),
    "volumes.delete": lambda c, sb: c.volumes.delete("v"),
    "templates.delete": lambda c, sb: c.templates.delete("base"),
    "templates.builds": lambda c, sb: c.templates.builds(),
    "templates.get_build": lambda c, sb: c.templates.get_build("b1"),
    "templates.register": lambda c, sb: c.templates.register("t", "registry.invalid/x:1"),
    "tokens.list": lambda c, sb: c.tokens.list(),
    "tokens.create": lambda c, sb: c.tokens.create("ci"),
    "tokens.revoke": lambda c, sb: c.tokens.revoke("pds_0"),
    "apps.list": lambda c, sb: c.apps.list(),
    "apps.get": lambda c, sb: c.apps.get("a1"),
    "apps.deployments": lambda c, sb: c.apps.deployments("a1"),
    "apps.rollback": lambda c, sb: c.apps.rollback("a1"),
    "apps.set_env": lambda c, sb: c.apps.set_env("a1", "K", "v"),
    "apps.domains": lambda c, sb: c.apps.domains("a1"),
    "apps.preview_repos": lambda c, sb: c.apps.preview_repos(),
    "apps.list_preview_env": lambda c, sb: c.apps.list_preview_env(1),
    "databases.list": lambda c, sb: c.databases.list(),
    "databases.get": lambda c, sb: c.databases.get("d1"),
    "databases.connection": lambda c, sb: c.databases.connection("d1"),
    "databases.reset_credentials": lambda c, sb: c.databases.reset_credentials("d1"),
    "functions.list": lambda c, sb: c.functions.list(),
    "functions.invoke": lambda c, sb: c.functions.invoke("f1", input={"x": 1}),
    "functions.runs": lambda c, sb: c.functions.runs("f1"),
    "schedules.list": lambda c, sb: c.schedules.list(),
    "schedules.create": lambda c, sb: c.schedules.create("s", "f1", "* * * * *"),
    "schedules.trigger": lambda c, sb: c.schedules.trigger("s1"),
    "create from_snapshot": lambda c, sb: c.sandboxes.create(template="base", from_snapshot="snap-1"),
    "create volumes": lambda c, sb: c.sandboxes.create(template="base", volumes=[{"name": "v"}]),
}


@pytest.mark.parametrize("call", list(SDK_CALLS), ids=list(SDK_CALLS))
def test_each_sdk_method_raises_server_error_saying_not_supported(local_server, sandbox, call: str) -> None:
    client = local_server.client()
    before = {s.id for s in client.sandboxes.list()}
    with pytest.raises(pandastack.ServerError, match="is not supported by pandastack-local"):
        SDK_CALLS[call](client, sandbox)
    assert {s.id for s in client.sandboxes.list()} == before  # a refused create made nothing


def test_unknown_paths_still_404_in_the_envelope(local_http, sandbox) -> None:
    for path in ("/v1/nope", f"/v1/sandboxes/{sandbox.id}/nope", "/v1/volumes/v/nope"):
        r = local_http.get(path)
        assert (r.status_code, r.json()) == (404, {"error": "not found"}), path
    # The feature is unsupported whatever the id: no 404 that suggests another sandbox would do.
    r = local_http.post(f"/v1/sandboxes/{UNKNOWN}/hibernate")
    assert r.status_code == 501 and "hibernating a sandbox" in r.json()["error"]


def test_real_routes_win_over_the_table(local_http, sandbox) -> None:
    """The table is mounted after the real routes: a template named like a row still resolves,
    and GET /v1/templates/builds is the builds answer, not the template lookup's 404."""
    assert local_http.get("/v1/templates/base").json()["name"] == "base"
    assert local_http.get("/v1/templates/builds").status_code == 501
    assert local_http.post(f"/v1/sandboxes/{sandbox.id}/exec", json={"cmd": "true"}).status_code == 200
