"""Prefect fixtures: import them into a conftest or test module to use them there.

``prefect_api`` runs one ephemeral Prefect API for the session; ``fast_redelivery`` keeps the
jittered redelivery delay short (the default base is 2 s).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from prefect.testing.utilities import prefect_test_harness


@pytest.fixture(scope="session", autouse=True)
def prefect_api() -> Iterator[None]:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The ephemeral server migrates a fresh SQLite DB on start: 70-80 s measured on a loaded two-core machine.
    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(autouse=True)
def fast_redelivery(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_INTEGRATIONS_PANDASTACK_RETRY_BASE_SECONDS", "0.2")
