"""The Prefect flow's queue tests: tests/prefect's ephemeral Prefect API and fixtures, with the
brokers of tests/queue (this directory runs in the Prefect venv only)."""

from tests.prefect.conftest import credentials, fast_redelivery, prefect_api

__all__ = ["credentials", "fast_redelivery", "prefect_api"]
