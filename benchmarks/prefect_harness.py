"""What the Prefect benchmarks (run in ``.venv-prefect``) share: a throwaway Prefect API server."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def prefect_server(startup_timeout: int) -> Iterator[None]:
    """Prefect's test harness server (analytics off) for the benchmark's flows and tasks."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=startup_timeout):
        yield
