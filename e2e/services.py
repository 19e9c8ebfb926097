"""The shared services of the topology: PostgreSQL, Redis and the local PandaStack server.

All three are started in the foreground under the run's :class:`ProcessGroup`,
on 127.0.0.1 and free ports, with their state in the run directory.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pandastack_local.testing.waiting import wait_for

from .procs import ProcessGroup, free_port, port_open, run

REPO = Path(__file__).resolve().parent.parent


class HTTPFailure(AssertionError):
    """An API answered with an error status; the message has the method, path and the detail."""

    def __init__(self, method: str, url: str, code: int, detail: str) -> None:
        super().__init__(f"{method} {url} -> {code}: {detail}")
        self.code = code


def request_json(
    method: str, url: str, body: Any = None, headers: dict[str, str] | None = None, timeout: float = 30
) -> Any:
    """One JSON request to a loopback API (bounded); the decoded answer, None when empty."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(  # noqa: S310 - loopback http only
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - loopback
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        raise HTTPFailure(method, url, exc.code, exc.read().decode(errors="replace")[:2000]) from None
    return json.loads(raw) if raw else None


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        raise AssertionError(f"PostgreSQL's {name} not found: run e2e/run.sh (it installs postgresql)")
    return found[-1]


@dataclass
class Postgres:
    port: int
    data_dir: Path

    def url(self, db: str, driver: str = "psycopg2") -> str:
        return f"postgresql+{driver}://postgres@127.0.0.1:{self.port}/{db}"

    def create_db(self, name: str) -> None:
        run(
            [
                _pg_bin("psql"),
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                "postgres",
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                f"CREATE DATABASE {name}",
            ],
            timeout=60,
        )


def start_postgres(group: ProcessGroup) -> Postgres:
    base = group.run_dir / "postgres"
    base.mkdir(mode=0o755)
    shutil.chown(base, "postgres", "postgres")
    data = base / "data"
    run(
        [_pg_bin("initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"],
        user="postgres",
        timeout=120,
        log=group.log_dir / "initdb.log",
    )
    port = free_port()
    group.start(
        "postgres",
        [
            _pg_bin("postgres"),
            "-D",
            str(data),
            "-p",
            str(port),
            "-h",
            "127.0.0.1",
            "-k",
            str(base),
            "-c",
            "fsync=off",
            "-c",
            "max_connections=300",
            "-c",
            "shared_buffers=64MB",
        ],
        user="postgres",
        stop_signal=signal.SIGINT,  # fast shutdown
        ports=[port],
    )
    pg = Postgres(port, data)
    wait_for(
        "postgres to accept connections",
        lambda: run([_pg_bin("pg_isready"), "-h", "127.0.0.1", "-p", str(port)], timeout=10),
        timeout=60,
        on_timeout=lambda: group.get("postgres").tail(),
    )
    return pg


@dataclass
class Redis:
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def start_redis(group: ProcessGroup) -> Redis:
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    port = free_port()
    rdir = group.run_dir / "redis"
    rdir.mkdir()
    group.start(
        "redis",
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(rdir),
            "--protected-mode",
            "yes",
        ],
        ports=[port],
    )
    wait_for(
        "redis to listen", lambda: port_open(port), timeout=30, on_timeout=lambda: group.get("redis").tail()
    )
    return Redis(port)


@dataclass
class PandaStack:
    """The local PandaStack-compatible server, with a small client for the assertions."""

    url: str
    api_key: str
    port: int

    def _req(self, method: str, path: str, body: Any = None, timeout: float = 15) -> Any:
        auth = {"Authorization": f"Bearer {self.api_key}"}
        return request_json(method, f"{self.url}/v1{path}", body, auth, timeout)

    def sandboxes(self) -> list[dict[str, Any]]:
        items = self._req("GET", "/sandboxes")
        if isinstance(items, dict):
            items = items.get("items", [])
        return [sb for sb in items if sb.get("status") not in ("deleted", "stopped")]

    def engine_sandboxes(self, engine: str, **match: str) -> list[dict[str, Any]]:
        """Live sandboxes an engine's jobs created, whose metadata also matches ``match``."""
        out = []
        for sb in self.sandboxes():
            meta = sb.get("metadata") or {}
            if meta.get("job_engine") == engine and all(meta.get(k) == v for k, v in match.items()):
                out.append(sb)
        return out

    def delete(self, sandbox_id: str) -> None:
        try:
            self._req("DELETE", f"/sandboxes/{sandbox_id}")
        except HTTPFailure as exc:
            if exc.code != 404:
                raise

    def env(self) -> dict[str, str]:
        return {"PANDASTACK_API": self.url, "PANDASTACK_API_KEY": self.api_key}


E2E_API_KEY = "pds_e2e0000000000000000000000000000"  # fixed, loopback-only, never a real key


def start_pandastack(
    group: ProcessGroup, python: str, name: str = "pandastack-local", extra_args: Sequence[str] = ()
) -> PandaStack:
    """A pandastack-local server of this run (``extra_args``: more ``serve`` options)."""
    port = free_port()
    state = group.run_dir / f"state-{port}"  # short: agent socket paths live below it (AF_UNIX: 108 bytes)
    state.mkdir()
    exe = str(Path(python).parent / "pandastack-local")
    argv = [exe, "serve", "--host", "127.0.0.1", "--port", str(port), "--api-key", E2E_API_KEY]
    group.start(
        name,
        [*argv, "--state-dir", str(state), *extra_args],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=REPO,
        ports=[port],
    )
    ps = PandaStack(f"http://127.0.0.1:{port}", E2E_API_KEY, port)
    wait_for(
        f"the {name} server to answer",
        ps.sandboxes,
        timeout=60,
        check=lambda _: True,
        on_timeout=lambda: group.get(name).tail(),
    )
    return ps
