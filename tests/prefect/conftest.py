"""Prefect tests: one ephemeral Prefect API for the session, real flows against pandastack_local."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from prefect.testing.utilities import prefect_test_harness

from prefect_blocks import PandaStackCredentials


@pytest.fixture(scope="session", autouse=True)
def prefect_api() -> Iterator[None]:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    with prefect_test_harness(server_startup_timeout=60):
        yield


@pytest.fixture(autouse=True)
def fast_redelivery(monkeypatch: pytest.MonkeyPatch) -> None:
    # Keep the jittered redelivery delay short in tests (the default base is 2 s).
    monkeypatch.setenv("PREFECT_INTEGRATIONS_PANDASTACK_RETRY_BASE_SECONDS", "0.2")


@pytest.fixture
def credentials(local_server: Any) -> PandaStackCredentials:
    return PandaStackCredentials(api_url=local_server.url, api_key=local_server.api_key)
