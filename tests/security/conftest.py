"""Fixtures for the hostile-tenant suite: one private server with a small template, and a helper
that runs a Python attack script inside a sandbox and returns its JSON report.

Every test here attacks the host through the real SDK. A test that touches host state (device
nodes, keyrings, per-user limits) records it first and restores it in its teardown, so a wall
that fails can never leave the machine broken.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandastack
import pytest

from pandastack_local import LocalServer
from tests.support.server import fail_on_leftovers, write_template

SMALL = {"name": "small", "cpu": 1, "memory_mb": 256, "disk_mb": 64, "pids_max": 64, "nofile": 256}


@contextlib.contextmanager
def private_server(factory: pytest.TempPathFactory, **template: Any) -> Iterator[LocalServer]:
    """A private server (warm pool off: every sandbox is a fresh start) with one template of its own."""
    base = factory.mktemp(f"{template['name']}-templates")
    with LocalServer(
        template_dirs=[str(write_template(base / template["name"], **template))], pool_size=0
    ) as s:
        yield s


@pytest.fixture(scope="session")
def security_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    """The suite's server, with the small template."""
    with private_server(tmp_path_factory, **SMALL) as server:
        yield server


@pytest.fixture
def security_client(security_server: LocalServer) -> Iterator[Any]:
    yield security_server.client()
    fail_on_leftovers(security_server)


@pytest.fixture
def sandbox(security_client: Any) -> Iterator[Any]:
    """One small sandbox, killed after the test."""
    sb = security_client.sandboxes.create(template="small")
    try:
        yield sb
    finally:
        with contextlib.suppress(pandastack.NotFoundError):  # the test may have killed it already
            sb.kill()


@pytest.fixture
def make_template(tmp_path: Path) -> Callable[..., str]:
    """make_template(name=..., memory_mb=..., ...): a template directory for a private server."""

    def make(**spec: object) -> str:
        return str(write_template(tmp_path / "templates" / str(spec["name"]), **spec))

    return make


@pytest.fixture
def run_script() -> Callable[..., dict[str, Any]]:
    """run_script(sb, source, *args): run ``source`` with python3 in ``sb``; its last stdout line is JSON."""

    def run(sb: Any, source: str, *args: object, timeout: int = 60) -> dict[str, Any]:
        sb.filesystem.write("/work/attack.py", source)
        argv = " ".join(f"'{a}'" for a in args)
        result = sb.exec(f"python3 /work/attack.py {argv}", timeout_seconds=timeout)
        lines = result.stdout.strip().splitlines()
        assert result.exit_code == 0 and lines, f"attack script failed: {result}"
        report: dict[str, Any] = json.loads(lines[-1])
        return report

    return run
