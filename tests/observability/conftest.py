"""Fixtures of the observability tests: a real Redis (per module) and a real Kafka (once), on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from e2e.brokers import Kafka, Redis, broker_processes


@pytest.fixture(scope="module")
def redis_broker() -> Iterator[Redis]:
    with broker_processes() as group:
        yield Redis(group)


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[Kafka]:
    """Apache Kafka (KRaft, its jars from tests/queue/kafka/jars.sh, cached), started once."""
    with broker_processes() as group:
        yield Kafka(group)
