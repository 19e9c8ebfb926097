"""``pandastack-jobs consume``: a clear error for a broker it cannot reach, or cannot read, and for a
PandaStack API it cannot reach or that refuses its key; the API it uses named at the start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e.brokers import AWS_ENV, Broker
from e2e.procs import free_port
from pandastack_local import LocalServer
from pandastack_local.testing.waiting import wait_for
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


# -- the PandaStack API at the start (issue 33, issue 36) -------------------------------------------

KEY = "pds_0123456789abcdef0123456789abcdef"


def _consume_with(broker: Broker, queue: str, home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``consume`` with only the PandaStack variables given (none inherited, no config file)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("PANDASTACK_")}
    full = {**base, **AWS_ENV, "PYTHONPATH": str(REPO), "HOME": str(home), **env}
    argv = [sys.executable, "-m", "pandastack_jobs.queue.cli", "consume", "--broker", broker.url(queue)]
    return subprocess.run(argv, env=full, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_an_unreachable_api_is_named_and_exits_4(broker: Broker, queue: str, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    started = time.monotonic()
    cp = _consume_with(broker, queue, tmp_path, PANDASTACK_API=url, PANDASTACK_API_KEY=KEY)
    assert cp.returncode == 4, cp.stderr
    lines = cp.stderr.strip().splitlines()
    assert lines[0] == f"pandastack-jobs: PandaStack API {url} (PANDASTACK_API)", lines
    assert len(lines) == 2 and f"cannot reach the PandaStack API at {url}" in lines[1], lines
    assert KEY not in cp.stderr + cp.stdout and "Traceback" not in cp.stderr
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_a_refused_or_missing_key_exits_5_without_showing_it(
    broker: Broker, queue: str, tmp_path: Path, local_server: LocalServer
) -> None:
    cp = _consume_with(broker, queue, tmp_path, PANDASTACK_API=local_server.url, PANDASTACK_API_KEY=KEY)
    assert cp.returncode == 5, cp.stderr
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 2 and "refused the key" in lines[1] and local_server.url in lines[1], lines
    assert KEY not in cp.stderr + cp.stdout and local_server.api_key not in cp.stderr
    cp = _consume_with(broker, queue, tmp_path, PANDASTACK_API=local_server.url)
    assert cp.returncode == 5, cp.stderr
    assert cp.stderr.strip().splitlines()[-1] == (
        "pandastack-jobs: no PandaStack API key: set PANDASTACK_API_KEY"
    ), cp.stderr


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_without_pandastack_api_the_hosted_api_is_named(broker: Broker, queue: str, tmp_path: Path) -> None:
    """Issue 36: PANDASTACK_API unset means the hosted API; consume says so (here it cannot reach it:
    every request goes to a proxy nobody listens on, so the test never leaves the machine)."""
    proxy = f"http://127.0.0.1:{free_port()}"
    cp = _consume_with(
        broker, queue, tmp_path, PANDASTACK_API_KEY=KEY, HTTPS_PROXY=proxy, https_proxy=proxy, NO_PROXY=""
    )
    assert cp.returncode == 4, cp.stderr
    first = cp.stderr.strip().splitlines()[0]
    assert first.startswith("pandastack-jobs: PandaStack API https://"), first
    assert "the hosted API: PANDASTACK_API is not set" in first, first
    assert KEY not in cp.stderr


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_a_good_api_is_named_and_sigterm_says_it_drains(
    broker: Broker, queue: str, tmp_path: Path, local_server: LocalServer
) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PANDASTACK_")},
        **local_server.env(),
        "PYTHONPATH": str(REPO),
        "HOME": str(tmp_path),
    }
    argv = [sys.executable, "-m", "pandastack_jobs.queue.cli", "consume", "--broker", broker.url(queue)]
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(
            "the API line",
            lambda: log.read_text(),
            timeout=30,
            check=lambda t: "PandaStack API" in t,
        )
        time.sleep(0.5)  # let it reach its loop; nothing to poll from outside
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log.read_text()
    assert f"PandaStack API {local_server.url} (PANDASTACK_API)" in text, text
    assert "draining 0 job(s)" in text and "drained:" in text, text
    assert local_server.api_key not in text
