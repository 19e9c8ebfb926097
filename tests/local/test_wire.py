"""Wire compatibility: status codes, envelopes and SDK exceptions, as the real server answers."""

from __future__ import annotations

import time

import httpx
import pandastack
import pytest


@pytest.fixture
def http(local_server):
    auth = {"Authorization": f"Bearer {local_server.api_key}"}
    with httpx.Client(base_url=local_server.url, headers=auth) as c:
        yield c


def test_auth_missing_and_wrong_key(local_server) -> None:
    r = httpx.get(f"{local_server.url}/v1/sandboxes")
    assert r.status_code == 401
    assert r.json() == {"error": "unauthorized", "detail": "missing bearer token"}
    r = httpx.get(f"{local_server.url}/v1/sandboxes", headers={"Authorization": "Bearer pds_" + "0" * 32})
    assert r.status_code == 401
    assert r.json() == {"error": "unauthorized", "detail": "invalid api token"}
    with pytest.raises(pandastack.AuthError):
        local_server.client(api_key="pds_" + "1" * 32).sandboxes.list()
    # Unknown routes under /v1 are also behind auth.
    assert httpx.get(f"{local_server.url}/v1/nope").status_code == 401


def test_health_and_version_need_no_auth(local_server) -> None:
    assert httpx.get(f"{local_server.url}/healthz").json()["status"] == "ok"
    assert "version" in httpx.get(f"{local_server.url}/version").json()


def test_error_envelope_for_framework_errors(http) -> None:
    r = http.get("/v1/no/such/route")
    assert (r.status_code, r.json()) == (404, {"error": "not found"})
    r = http.put("/v1/sandboxes")
    assert r.status_code == 405 and r.json() == {"error": "method not allowed"}


def test_list_is_a_bare_array_and_delete_is_204(http) -> None:
    r = http.post("/v1/sandboxes", json={"template": "base"})
    assert r.status_code == 201
    sid = r.json()["id"]
    listed = http.get("/v1/sandboxes").json()
    assert isinstance(listed, list) and sid in [s["id"] for s in listed]
    fields = {"id", "template", "cpu", "memory_mb", "status", "created_at", "metadata", "boot_ms"}
    assert set(r.json()) >= fields
    r = http.delete(f"/v1/sandboxes/{sid}")
    assert (r.status_code, r.content) == (204, b"")
    assert http.get(f"/v1/sandboxes/{sid}").status_code == 404
    assert http.delete(f"/v1/sandboxes/{sid}").json() == {"error": "not found"}


def test_bad_create_requests_change_nothing(http, ps_client) -> None:
    before = http.get("/v1/sandboxes").json()
    r = http.post("/v1/sandboxes", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "invalid JSON" in r.json()["error"]
    with pytest.raises(pandastack.BadRequestError, match="invalid template name"):
        ps_client.sandboxes.create(template="../etc")
    with pytest.raises(pandastack.ServerError, match=r"available templates: .*base.*code-interpreter"):
        ps_client.sandboxes.create(template="no-such-template")
    with pytest.raises(pandastack.BadRequestError, match="ttl_seconds must not be negative"):
        ps_client.sandboxes.create(ttl_seconds=-5)
    assert http.get("/v1/sandboxes").json() == before


def test_unknown_sandbox_is_404_everywhere(ps_client, http) -> None:
    missing = "00000000-0000-4000-8000-000000000000"
    with pytest.raises(pandastack.NotFoundError):
        ps_client.sandboxes.get(missing)
    with pytest.raises(pandastack.NotFoundError):
        ps_client.sandboxes.delete(missing)
    for method, path in [
        ("POST", "exec"),
        ("GET", "fs?path=/x"),
        ("GET", "lifecycle"),
        ("POST", "pause"),
        ("GET", "logs"),
        ("POST", "fork"),
    ]:
        r = http.request(method, f"/v1/sandboxes/{missing}/{path}", json={"cmd": "true"})
        assert (r.status_code, r.json()) == (404, {"error": "not found"}), path


def test_fs_errors(ps_client, http) -> None:
    with ps_client.sandboxes.create() as sb:
        with pytest.raises(pandastack.ServerError, match="No such file or directory"):
            sb.filesystem.read("/work/missing.txt")
        with pytest.raises(pandastack.NotFoundError, match="file does not exist"):
            sb.filesystem.stat("/work/missing.txt")
        with pytest.raises(pandastack.BadRequestError, match="path must be absolute"):
            sb.filesystem.read("work/relative.txt")
        with pytest.raises(pandastack.BadRequestError, match=r"\.\."):
            sb.filesystem.read("/work/../../etc/passwd")
        with pytest.raises(pandastack.ServerError):
            sb.filesystem.listdir("/work/missing-dir")
        big = b"x" * (32 * 1024 * 1024 + 1)
        r = http.put(f"/v1/sandboxes/{sb.id}/fs", params={"path": "/work/big.bin"}, content=big)
        assert r.status_code == 413 and "too large" in r.json()["error"]
        with pytest.raises(pandastack.BadRequestError, match="too large"):
            sb.filesystem.write("/work/big.bin", big)
        assert not sb.filesystem.exists("/work/big.bin")
        exactly = b"y" * (32 * 1024 * 1024)
        assert sb.filesystem.write("/work/ok.bin", exactly)["bytes"] == len(exactly)
        assert sb.filesystem.stat("/work/ok.bin").size == len(exactly)
        r = http.delete(f"/v1/sandboxes/{sb.id}/fs", params={"path": "/work/ok.bin"})
        assert r.status_code == 204
        assert not sb.filesystem.exists("/work/ok.bin")
        r = http.post(f"/v1/sandboxes/{sb.id}/exec", json={"timeout_seconds": 3})
        assert (r.status_code, r.json()) == (400, {"error": "cmd required"})
        json_type = {"Content-Type": "application/json"}
        r = http.post(f"/v1/sandboxes/{sb.id}/exec", content=b"[1,", headers=json_type)
        assert r.status_code == 400


def test_exec_timeout_kills_the_tree_and_uses_the_timeout_shape(ps_client, http) -> None:
    with ps_client.sandboxes.create() as sb:
        started = time.monotonic()
        with pytest.raises(pandastack.SandboxTimeout):
            sb.exec("sleep 777 & sleep 778; echo never", timeout_seconds=1)
        assert time.monotonic() - started < 10
        r = http.post(f"/v1/sandboxes/{sb.id}/exec", json={"cmd": "sleep 30", "timeout_seconds": 1})
        assert r.status_code >= 500
        message = r.json()["error"]
        assert "timeout" in message
        for phrase in ("i/o timeout", "connect: connection refused", "no route to host"):
            assert phrase not in message
        procs = sb.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout
        assert "sleep 777" not in procs and "sleep 778" not in procs and "sleep 30" not in procs
        with pytest.raises(pandastack.SandboxTimeout):
            sb.exec_stream("echo before; sleep 30", timeout_seconds=1)


def test_signal_exit_codes_are_200(ps_client) -> None:
    with ps_client.sandboxes.create() as sb:
        assert sb.exec("kill -KILL $$").exit_code == 137
        assert sb.exec("kill -TERM $$").exit_code == 143
        suicide = "python3 -c 'import os, signal; os.kill(os.getpid(), signal.SIGKILL)'"
        assert sb.exec(suicide).exit_code == 137


def test_lifecycle_get_patch(ps_client, http) -> None:
    with ps_client.sandboxes.create(ttl_seconds=600) as sb:
        life = sb.lifecycle()
        assert set(life) == {"ttl_seconds", "persistent", "idle_seconds"}
        assert life["ttl_seconds"] == 600 and life["persistent"] is False
        assert sb.set_ttl(900)["ttl_seconds"] == 900
        with pytest.raises(pandastack.BadRequestError):
            sb.set_ttl(-1)
        assert sb.lifecycle()["ttl_seconds"] == 900
        r = http.patch(f"/v1/sandboxes/{sb.id}/lifecycle", content=b"nope")
        assert r.status_code == 400
    with ps_client.sandboxes.create() as sb:
        assert sb.lifecycle()["ttl_seconds"] == 300  # the platform's default idle TTL


def test_logs_and_secret_metadata(ps_client) -> None:
    sb = ps_client.sandboxes.create(metadata={"job": "x", "secret.token": "hunter2"})
    try:
        assert sb.metadata == {"job": "x"}
        assert ps_client.sandboxes.get(sb.id).metadata == {"job": "x"}
        sb.exec("echo hello-logs")
        text = "\n".join(sb.logs())
        assert "echo hello-logs" in text and "hunter2" not in text
    finally:
        sb.kill()


def test_pause_and_resume(ps_client, http) -> None:
    with ps_client.sandboxes.create() as sb:
        # Each tick replaces the file whole (a read never lands between a truncate and a write).
        tick = "date +%s%N > /work/tick.new && mv /work/tick.new /work/tick"
        sb.exec(f"nohup sh -c 'while true; do {tick}; sleep 0.05; done' >/dev/null 2>&1 &")
        # The loop's first tick, before the pause (a loaded gVisor host starts it seconds late).
        started = sb.exec("for i in $(seq 300); do [ -s /work/tick ] && exit 0; sleep 0.1; done; exit 1")
        assert started.exit_code == 0, "the ticking loop never wrote /work/tick"
        sb.pause()
        assert ps_client.sandboxes.get(sb.id).status == "paused"
        r = http.post(f"/v1/sandboxes/{sb.id}/exec", json={"cmd": "true"})
        assert r.status_code == 409 and "paused" in r.json()["error"]
        sb.resume()
        first = sb.filesystem.read("/work/tick")
        deadline = time.monotonic() + 10  # a loaded host: the loop ticks again soon, not at once
        while sb.filesystem.read("/work/tick") == first and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sb.filesystem.read("/work/tick") != first, "the sandbox's processes did not resume"
        assert ps_client.sandboxes.get(sb.id).status == "running"
