"""Fixtures of the queue tests: one real broker per transport (started once, lazily), a fresh queue
per test, an in-process consumer in a thread and a real subprocess consumer for kill tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.brokers import AWS_ENV, KINDS, Broker, LazyBrokers
from pandastack_jobs import ConnectionConfig
from pandastack_jobs.queue import Consumer, Stats
from pandastack_local import LocalServer
from pandastack_local.testing.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
TRANSPORTS = list(KINDS)
# Small jobs on the base template, short leases: the whole suite stays within minutes.
DEFAULTS = {"template": "base", "timeout": 30}
LEASE = 2.0
# The RabbitMQ transport signs its work queue's stamps with this (else with the API key): the
# in-process transports and the subprocess workers (which inherit the environment) share it.
os.environ.setdefault("PANDASTACK_QUEUE_SECRET", f"test-{uuid.uuid4().hex}")


@pytest.fixture(params=TRANSPORTS)
def broker(request: pytest.FixtureRequest, brokers: LazyBrokers) -> Broker:
    return brokers.get(request.param)


@pytest.fixture
def queue() -> str:
    return f"q{uuid.uuid4().hex[:10]}"


def message(command: str, id: str | None = None, **options: Any) -> bytes:
    doc: dict[str, Any] = {"command": command}
    if id is not None:
        doc["id"] = id
    if options:
        doc["options"] = options
    return json.dumps(doc).encode()


# A job that writes its message id and delivery as its result, after sleeping ``s`` seconds.
def echo_job(s: float = 0) -> str:
    sleep = f"sleep {s} && " if s else ""
    return (
        sleep
        + 'printf \'{"id": "%s", "delivery": %s}\' "$QUEUE_MESSAGE_ID" "$QUEUE_DELIVERY" > "$JOB_RESULT"'
    )


class Running:
    """A consumer running in a thread of this process."""

    def __init__(self, consumer: Consumer, until: Callable[[Stats], bool] | None) -> None:
        self.consumer = consumer
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(until,), daemon=True)
        self.thread.start()

    def _run(self, until: Callable[[Stats], bool] | None) -> None:
        try:
            self.consumer.run(until)
        except BaseException as exc:  # reported by join()
            self.error = exc

    def join(self, timeout: float = 60) -> Stats:
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.consumer.stop()
            self.thread.join(30)
            raise AssertionError(f"consumer did not finish in {timeout}s: {self.consumer.stats}")
        if self.error is not None:
            raise self.error
        return self.consumer.stats


@pytest.fixture
def start_consumer(broker: Broker, queue: str, local_server: LocalServer) -> Iterator[Callable[..., Running]]:
    running: list[Running] = []

    def start(until: Callable[[Stats], bool] | None = None, lease: float = LEASE, **kw: Any) -> Running:
        kw.setdefault("defaults", DEFAULTS)
        kw.setdefault("release_delay", 0.2)
        kw.setdefault("poll_seconds", 0.3)
        conn = ConnectionConfig(api_url=local_server.url, api_key=local_server.api_key)
        r = Running(Consumer(broker.transport(queue, lease), conn, **kw), until)
        running.append(r)
        return r

    yield start
    for r in running:
        r.consumer.stop()
        r.thread.join(60)


class Worker:
    """``pandastack-jobs consume`` as a real subprocess (its own process group)."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.popen = subprocess.Popen(
                argv,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=REPO,
            )

    def signal(self, sig: int) -> None:
        os.killpg(self.popen.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def spawn_worker(
    broker: Broker, queue: str, local_server: LocalServer, tmp_path: Path
) -> Iterator[Callable[..., Worker]]:
    workers: list[Worker] = []

    def spawn(*extra: str, lease: float = LEASE) -> Worker:
        argv = [
            sys.executable,
            "-m",
            "pandastack_jobs.queue.cli",
            "consume",
            "--broker",
            broker.url(queue),
            "--template",
            "base",
            "--timeout",
            "30",
            "--lease",
            str(lease),
            "--release-delay",
            "0.2",
            "--progress-every",
            "0.5",
            "--log-level",
            "INFO",
            *extra,
        ]
        env = {
            **os.environ,
            **local_server.env(),
            **AWS_ENV,
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
        }
        w = Worker(argv, env, tmp_path / f"worker-{len(workers)}.log")
        workers.append(w)
        return w

    yield spawn
    for w in workers:
        if w.popen.poll() is None:
            w.signal(signal.SIGKILL)
            w.popen.wait(10)


def live_sandboxes(server: LocalServer, **match: str) -> list[Any]:
    out = []
    for sb in server.client().sandboxes.list():
        meta = sb.metadata or {}
        if all(meta.get(k) == v for k, v in match.items()):
            out.append(sb)
    return out


def wait_results(broker: Broker, queue: str, n: int, timeout: float = 60) -> list[dict[str, Any]]:
    return wait_for(
        f"{n} result(s) on {broker.name}:{queue}",
        lambda: broker.results(queue),
        timeout=timeout,
        interval=0.3,
        check=lambda rs: len(rs) >= n,
    )


def settle(seconds: float) -> None:
    time.sleep(seconds)
