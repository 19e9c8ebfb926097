"""``pandastack-jobs consume``: a clear error for a broker it cannot reach, or cannot read."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from e2e.procs import free_port
from tests.queue.brokers import AWS_ENV
from tests.queue.conftest import REPO


def _consume(broker: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **AWS_ENV, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "pandastack_jobs.queue.cli", "consume", "--broker", broker]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "url",
    [
        "redis://:s3cret@127.0.0.1:{port}/0?stream=jobs",
        "postgresql://user:s3cret@127.0.0.1:{port}/db?queue=jobs",
        "amqp://guest:s3cret@127.0.0.1:{port}/%2F?queue=jobs",
        "sqs://jobs?endpoint_url=http://127.0.0.1:{port}&region=us-east-1",
        "kafka://user:s3cret@127.0.0.1:{port}?topic=jobs&group=workers",
    ],
)
def test_an_unreachable_broker_is_a_clear_error(url: str) -> None:
    port = free_port()  # nobody listens there
    started = time.monotonic()
    cp = _consume(url.format(port=port))
    assert cp.returncode == 3, cp.stderr
    assert "cannot reach the broker" in cp.stderr and f"127.0.0.1:{port}" in cp.stderr, cp.stderr
    assert "s3cret" not in cp.stderr  # the password is not echoed
    assert "Traceback" not in cp.stderr
    assert time.monotonic() - started < 30


def test_an_unknown_scheme_names_the_known_ones() -> None:
    cp = _consume("nats://127.0.0.1:4222/jobs")
    assert cp.returncode == 2
    assert "--broker" in cp.stderr and "'nats'" in cp.stderr and "redis" in cp.stderr and "kafka" in cp.stderr
