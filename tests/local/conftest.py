"""Fixtures for the local server's own tests: a small template and a private server using it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from pandastack_local import LocalServer
from tests.support.server import fail_on_leftovers, write_template

CANARY_ENV = "PANDASTACK_LOCAL_TEST_CANARY"
CANARY_VALUE = "canary-3f9c1d"


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    """A private server with a 'small' template (256 MB, 64 pids, 64 MB disk, 128 files) and a
    canary variable in its environment that no sandbox may see."""
    base = tmp_path_factory.mktemp("templates")
    small = write_template(
        base / "small",
        {"/opt/app/hello.txt": "from the template\n"},
        name="small",
        cpu=1,
        memory_mb=256,
        pids_max=64,
        disk_mb=64,
        nofile=128,
    )
    os.environ[CANARY_ENV] = CANARY_VALUE
    try:
        server = LocalServer(template_dirs=[str(small)]).start()
    finally:
        del os.environ[CANARY_ENV]
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def canary() -> tuple[str, str]:
    """(name, value) of the variable set in small_server's environment."""
    return CANARY_ENV, CANARY_VALUE


@pytest.fixture
def small_client(small_server: LocalServer) -> Iterator[object]:
    yield small_server.client()
    fail_on_leftovers(small_server)
