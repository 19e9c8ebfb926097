"""Wire parity with the real PandaStack server (pandastack-io/pandastack-ai: api/cmd/api/auth.go,
agent/internal/guest/ssh.go, agent/internal/api/templates.go, orgs.go), through raw HTTP and the SDK."""

from __future__ import annotations

import httpx


def test_bearer_scheme_in_any_case_and_access_token_query(local_server) -> None:
    url, key = local_server.url, local_server.api_key
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = httpx.get(f"{url}/v1/sandboxes", headers={"Authorization": f"{scheme} {key}"})
        assert r.status_code == 200, (scheme, r.text)
    assert httpx.get(f"{url}/v1/sandboxes", params={"access_token": key}).status_code == 200
    wrong = httpx.get(f"{url}/v1/sandboxes", params={"access_token": "pds_" + "0" * 32})
    assert wrong.status_code == 401 and wrong.json()["detail"] == "invalid api token"


def test_fs_mode_is_the_type_letter_and_dir_defaults_to_root(ps_client, local_http) -> None:
    with ps_client.sandboxes.create(template="base") as sb:
        sb.exec("mkdir -p /work/d && echo x > /work/d/f && ln -s f /work/d/l")
        modes = {e.name: e.mode for e in sb.filesystem.listdir("/work/d")}
        assert modes == {"f": "f", "l": "l"}
        assert sb.filesystem.stat("/work/d").mode == "d"
        root = local_http.get(f"/v1/sandboxes/{sb.id}/fs/dir")
        assert root.status_code == 200 and root.json()["path"] == "/"
        assert {"work", "tmp", "usr"} <= {e["name"] for e in root.json()["entries"]}


def test_sse_frames_are_compact_json_and_whitespace_command_runs(ps_client, local_http) -> None:
    with ps_client.sandboxes.create(template="base") as sb:
        r = local_http.post(f"/v1/sandboxes/{sb.id}/exec/stream", json={"cmd": "echo hi"})
        assert 'data: {"chunk":"hi\\n"}' in r.text and 'data: {"exit_code":0}' in r.text, r.text
        blank = local_http.post(f"/v1/sandboxes/{sb.id}/exec", json={"cmd": "   "})
        assert blank.status_code == 200 and blank.json()["exit_code"] == 0, blank.text
        assert local_http.post(f"/v1/sandboxes/{sb.id}/exec", json={"cmd": ""}).status_code == 400


def test_templates_list_get_and_me(local_http) -> None:
    listed = local_http.get("/v1/templates").json()
    by_name = {t["name"]: t for t in listed}
    assert {"base", "code-interpreter"} <= set(by_name)
    ci = by_name["code-interpreter"]
    assert (ci["cpu"], ci["memory_mb"], ci["disk_mb"]) == (2, 2048, 1024)
    assert "pandas==2.2.3" in ci["meta"]["requirements"]
    assert local_http.get("/v1/templates/base").json()["name"] == "base"
    missing = local_http.get("/v1/templates/nope")
    assert (missing.status_code, missing.json()) == (404, {"error": "not found"})
    me = local_http.get("/v1/me")
    assert me.status_code == 200 and me.json()["orgs"] == [] and "user_id" in me.json()


def test_one_shot_repl_and_languages(ps_client, local_http) -> None:
    """The real agent's one-shot REPL (agent/internal/api/repl.go): a fresh interpreter per
    snippet fed by a quoted heredoc, so shell syntax in the code is not expanded."""
    langs = local_http.get("/v1/repl/languages")
    assert langs.status_code == 200 and {"python", "py", "node", "js", "bash", "sh"} <= set(langs.json())
    with ps_client.sandboxes.create(template="base") as sb:
        url = f"/v1/sandboxes/{sb.id}/repl"
        r = local_http.post(url, json={"code": "import sys\nprint(6 * 7, '$HOME `id`')\nsys.exit(3)"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["language"], body["stdout"], body["exit_code"]) == ("python", "42 $HOME `id`\n", 3)
        node = local_http.post(url, json={"language": " JS ", "code": "console.error('x' + 1)"}).json()
        assert (node["language"], node["stderr"], node["exit_code"]) == ("js", "x1\n", 0)
        assert local_http.post(url, json={"code": "x = 1"}).json()["exit_code"] == 0
        kept = local_http.post(url, json={"code": "print(x)"}).json()  # no state between snippets
        assert kept["exit_code"] == 1 and "NameError" in kept["stderr"]
        for bad, field in (
            ({"language": "cobol", "code": "x"}, "unsupported language: cobol"),
            ({"language": 5, "code": "x"}, "language"),
            ({"code": 5}, "code"),
            ({"code": "a\n__FCS_EOF__\nid"}, "__FCS_EOF__"),
        ):
            refused = local_http.post(url, json=bad)
            assert refused.status_code == 400 and field in refused.json()["error"], (bad, refused.text)
    assert local_http.post("/v1/sandboxes/no-such/repl", json={"code": "1"}).status_code == 404
