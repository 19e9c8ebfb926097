"""Issue 25, item 1: pandastack-local next to Airflow and Prefect on one laptop.

Its default port must be nobody else's, a taken port must say so with the fix, and a request that
is plainly Airflow's (the Task SDK talking to the wrong port) must be told where it went.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import httpx

from pandastack_local.cli import build_parser

# Ports the tools a newcomer runs beside this one listen on by default.
NEIGHBOURS = {
    8080: "Airflow api-server",
    8793: "Airflow log server",
    8794: "Airflow triggerer logs",
    4200: "Prefect",
    5555: "Flower",
    8888: "Jupyter",
    8787: "Dask",
    5000: "MLflow",
    5432: "PostgreSQL",
    6379: "Redis",
    3000: "Dagster",
}


def test_default_port_is_no_neighbours() -> None:
    port = build_parser().parse_args(["serve"]).port
    assert port not in NEIGHBOURS, f"default port {port} is {NEIGHBOURS.get(port)}'s"


def test_taken_port_says_so_and_names_the_fix() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "pandastack_local", "serve", "--port", str(port), "--pool-size", "0"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert proc.returncode != 0
    assert f"127.0.0.1:{port}" in proc.stderr and "in use" in proc.stderr, proc.stderr[-2000:]
    assert "--port" in proc.stderr, proc.stderr[-2000:]
    assert "listening on" not in proc.stdout  # it never claimed to be up


def test_airflow_execution_api_path_is_told_it_hit_the_wrong_server(local_server) -> None:
    # What Airflow's Task SDK sends when its execution_api_server_url points at this port.
    for method, path in [
        ("PATCH", "/execution/task-instances/0190-abc/run"),
        ("GET", "/api/v2/version"),
        ("GET", "/api/health"),
        ("POST", "/execution"),
    ]:
        resp = httpx.request(method, local_server.url + path, json={}, timeout=10)
        assert resp.status_code == 421, (path, resp.status_code, resp.text)
        body = resp.json()
        assert "pandastack-local" in body["error"] and "--port" in body["error"], body
        assert body["path"] == path
    assert "Execution API" in httpx.patch(local_server.url + "/execution/x", timeout=10).json()["error"]


def test_pandastack_paths_keep_their_answers(local_server) -> None:
    # The foreign answers must not shadow PandaStack's own 404 / 405 / 401.
    assert httpx.get(local_server.url + "/nope", timeout=10).json() == {"error": "not found"}
    assert httpx.get(local_server.url + "/v1/sandboxes", timeout=10).status_code == 401
    assert httpx.get(local_server.url + "/healthz", timeout=10).status_code == 200
