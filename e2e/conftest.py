"""Session fixtures: one run directory, one process group, the shared services, and the
two orchestrators (each started by the module that uses it and stopped after it).

Logs of every process live under ``<run_dir>/logs`` and are printed when a test fails.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from .procs import ProcessGroup
from .services import PandaStack, Postgres, Redis, start_pandastack, start_postgres, start_redis

if TYPE_CHECKING:
    from e2e.brokers import Kafka

_GROUP: ProcessGroup | None = None


@pytest.fixture(scope="session")
def run_dir() -> Path:
    given = os.environ.get("E2E_RUN_DIR")
    path = Path(given) if given else Path(tempfile.mkdtemp(prefix="pandastack-e2e-"))
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o755)  # the postgres user must traverse it
    return path


@pytest.fixture(scope="session")
def group(run_dir: Path) -> Iterator[ProcessGroup]:
    global _GROUP
    _GROUP = ProcessGroup(run_dir)
    try:
        yield _GROUP
    finally:
        _GROUP.stop_all()
        print(f"\ne2e: logs of every process are in {_GROUP.log_dir}", file=sys.stderr)


@pytest.fixture(scope="session")
def postgres(group: ProcessGroup) -> Postgres:
    return start_postgres(group)


@pytest.fixture(scope="session")
def redis(group: ProcessGroup) -> Redis:
    return start_redis(group)


@pytest.fixture(scope="session")
def kafka(group: ProcessGroup) -> Kafka:
    """Apache Kafka (KRaft, one node), started once, by the first test that asks for it, with the
    queue tests' own starter (e2e/brokers.py; its jars cached by tests/queue/kafka/jars.sh)."""
    from e2e.brokers import Kafka

    return Kafka(group)


@pytest.fixture(scope="session")
def pandastack(group: ProcessGroup) -> PandaStack:
    return start_pandastack(group, sys.executable)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if report.failed and _GROUP is not None:
        report.sections.append(("e2e process logs (tails)", _GROUP.dump_logs(60)))
