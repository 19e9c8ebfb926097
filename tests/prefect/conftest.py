"""Prefect tests: one ephemeral Prefect API for the session, real flows against pandastack_local."""

from __future__ import annotations

from typing import Any

import pytest

from prefect_blocks import PandaStackCredentials
from tests.support.prefect_fixtures import fast_redelivery, prefect_api

__all__ = ["credentials", "fast_redelivery", "prefect_api"]


@pytest.fixture
def credentials(local_server: Any) -> PandaStackCredentials:
    return PandaStackCredentials(api_url=local_server.url, api_key=local_server.api_key)
