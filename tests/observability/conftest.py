"""Fixtures of the observability tests: a real Redis on loopback and a free port, per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.queue.brokers import Redis, broker_processes


@pytest.fixture(scope="module")
def redis_broker() -> Iterator[Redis]:
    with broker_processes() as group:
        yield Redis(group)
