"""What this session's red-team pass got through, closed (each seen failing on the code before).

- a TTL of 10**30 (create or PATCH) was accepted: a sandbox with no TTL in effect, not persistent;
- an exec ``timeout_seconds`` past a float's range was a plain-text 500 (OverflowError);
- a job's 2,500-level tree made ``DELETE fs`` (and a deep ``PUT fs``) a 500 RecursionError in the agent;
- ``io_setup`` let one sandbox claim the host's whole ``fs.aio-max-nr``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.server import GVISOR


@pytest.fixture
def sandbox(local_http: httpx.Client) -> Iterator[str]:
    r = local_http.post("/v1/sandboxes", json={"template": "base"})
    assert r.status_code == 201, r.text
    yield r.json()["id"]
    local_http.delete(f"/v1/sandboxes/{r.json()['id']}")


def _exec(http: httpx.Client, sid: str, cmd: str) -> dict[str, Any]:
    r = http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, "timeout_seconds": 120}, timeout=180)
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.parametrize("ttl", [10**30, 2**64 + 1, 7 * 86400 + 1])
def test_a_ttl_past_the_ceiling_is_a_400_on_create_and_on_patch(
    local_http: httpx.Client, sandbox: str, ttl: int
) -> None:
    r = local_http.post("/v1/sandboxes", content=f'{{"template": "base", "ttl_seconds": {ttl}}}')
    assert r.status_code == 400 and "ttl_seconds must be at most" in r.json()["error"], r.text
    r = local_http.patch(f"/v1/sandboxes/{sandbox}/lifecycle", content=f'{{"ttl_seconds": {ttl}}}')
    assert r.status_code == 400 and "ttl_seconds must be at most" in r.json()["error"], r.text
    assert local_http.get(f"/v1/sandboxes/{sandbox}/lifecycle").json()["ttl_seconds"] == 300


@pytest.mark.parametrize("route", ["exec", "exec/stream"])
def test_a_huge_exec_timeout_is_a_400_naming_the_field(
    local_http: httpx.Client, sandbox: str, route: str
) -> None:
    body = '{"cmd": "true", "timeout_seconds": 1' + "0" * 400 + "}"
    r = local_http.post(f"/v1/sandboxes/{sandbox}/{route}", content=body)
    assert r.status_code == 400 and "timeout_seconds must be at most" in r.json()["error"], r.text
    assert _exec(local_http, sandbox, "echo ok")["stdout"] == "ok\n"


def test_a_tree_deeper_than_the_agents_stack_is_deleted(local_http: httpx.Client, sandbox: str) -> None:
    made = _exec(
        local_http,
        sandbox,
        "python3 -c \"import os\nos.chdir('/tmp')\nfor _ in range(2501):\n"
        "    os.mkdir('d'); os.chdir('d'); open('f', 'w').close()\nprint('made')\"",
    )
    assert made["stdout"] == "made\n", made
    r = local_http.delete(f"/v1/sandboxes/{sandbox}/fs", params={"path": "/tmp/d"})
    assert r.status_code == 204, r.text
    assert local_http.get(f"/v1/sandboxes/{sandbox}/fs/stat", params={"path": "/tmp/d"}).status_code == 404


def test_a_write_deeper_than_the_agents_stack_is_a_4xx(local_http: httpx.Client, sandbox: str) -> None:
    path = "/tmp" + "/d" * 1900 + "/f"
    r = local_http.put(f"/v1/sandboxes/{sandbox}/fs", params={"path": path}, content=b"x")
    assert r.status_code < 500, r.text
    assert r.headers["content-type"].startswith("application/json"), r.text


def test_io_setup_cannot_claim_the_hosts_aio_limit(local_http: httpx.Client, sandbox: str) -> None:
    before = int(open("/proc/sys/fs/aio-nr").read())
    out = _exec(
        local_http,
        sandbox,
        'python3 -c "import ctypes, os; l = ctypes.CDLL(None, use_errno=True); c = ctypes.c_ulong(); '
        'r = l.syscall(206, 65536, ctypes.byref(c)); print(r, os.strerror(ctypes.get_errno()))"',
    )
    if not GVISOR:  # bwrap: seccomp refuses io_setup (gVisor's sentry implements AIO itself)
        assert out["stdout"].split()[0] == "-1", out
    assert int(open("/proc/sys/fs/aio-nr").read()) <= before, "a sandbox claimed host AIO contexts"
