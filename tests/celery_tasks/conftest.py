"""Fixtures of the Celery tests: real brokers (Redis, RabbitMQ) and a Redis result backend on
loopback and free ports, the session's pandastack-local server, and real ``celery worker``
processes (their own process groups, SIGKILLed at the end whatever happens)."""

from __future__ import annotations

import os
import signal
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

import pandastack_celery  # noqa: F401 - AsyncResult.get() rebuilds its SandboxJobFailed only once imported
from e2e.brokers import Broker, LazyBrokers, RabbitMQ, Redis
from e2e.celery_worker import Worker
from e2e.procs import ProcessGroup
from pandastack_local import LocalServer
from pandastack_local.testing.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
VISIBILITY = 10.0  # seconds before Redis gives a dead worker's unacked message to another
BROKERS = ["redis", "rabbitmq"]


class ResultRedis(Redis):
    """A second Redis: the result backend, so restarting the broker leaves the results alone."""

    name = "redis-results"


KINDS: dict[str, type[Broker]] = {"redis": Redis, "rabbitmq": RabbitMQ, "results": ResultRedis}


@pytest.fixture(params=BROKERS)
def broker(request: pytest.FixtureRequest, brokers: LazyBrokers) -> Broker:
    return brokers.get(request.param, KINDS[request.param])


@pytest.fixture
def redis_broker(brokers: LazyBrokers) -> Broker:
    return brokers.get("redis", Redis)


def broker_url(broker: Broker) -> str:
    if isinstance(broker, RabbitMQ):
        return f"amqp://guest:guest@127.0.0.1:{broker.port}//"
    return f"redis://127.0.0.1:{broker.port}/0"


class Celeryland:
    """A broker, the result backend, the local server and the workers of one test."""

    def __init__(
        self, group: ProcessGroup, broker: Broker, results: Broker, server: LocalServer, tmp: Path
    ) -> None:
        self.group, self.broker, self.results, self.server, self.tmp = group, broker, results, server, tmp
        self.queue = f"cq{uuid.uuid4().hex[:8]}"
        self.events = tmp / "events.log"
        self.workers: list[Worker] = []
        self.env = {
            **os.environ,
            **server.env(),
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
            "CELERY_TEST_BROKER": broker_url(broker),
            "CELERY_TEST_BACKEND": f"redis://127.0.0.1:{results.port}/0",
            "CELERY_TEST_QUEUE": self.queue,
            "CELERY_TEST_EVENTS": str(self.events),
            "CELERY_TEST_VISIBILITY": str(VISIBILITY),
            # The example app (celery_app/tasks.py) reads these.
            "CELERY_BROKER_URL": broker_url(broker),
            "CELERY_RESULT_BACKEND": f"redis://127.0.0.1:{results.port}/0",
            "EXAMPLE_TEMPLATE": "base",
        }
        self.app = Celery("sandboxed", set_as_current=False)
        self.app.conf.update(
            broker_url=self.env["CELERY_TEST_BROKER"],
            result_backend=self.env["CELERY_TEST_BACKEND"],
            task_default_queue=self.queue,
            broker_transport_options={"visibility_timeout": VISIBILITY},
        )

    def worker(self, concurrency: int = 2, module: str = "tests.celery_tasks.app") -> Worker:
        argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            module,
            "worker",
            "--loglevel",
            "INFO",
            "--pool",
            "prefork",
            "--concurrency",
            str(concurrency),
            "--hostname",
            f"w{len(self.workers)}-{self.queue}@%h",
            "--without-gossip",
            "--without-mingle",
            "--queues",
            self.queue,
        ]
        w = Worker(self.group, f"celery-{self.queue}-{len(self.workers)}", argv, self.env, self.events)
        self.workers.append(w)
        return w

    def send(self, name: str, *args: Any, **kwargs: Any) -> Any:
        full = name if "." in name else f"tests.celery_tasks.app.{name}"
        return self.app.send_task(full, args=args, kwargs=kwargs)

    def sandboxes(self, task_id: str) -> list[Any]:
        client = self.server.client()
        return [sb for sb in client.sandboxes.list() if (sb.metadata or {}).get("celery_task_id") == task_id]

    def close(self) -> None:
        for w in self.workers:
            if w.popen.poll() is None:
                os.killpg(w.popen.pid, signal.SIGKILL)
                w.popen.wait(10)
            self.group.procs.remove(w.proc)
        self.app.close()


@pytest.fixture
def make_land(
    brokers: LazyBrokers, local_server: LocalServer, tmp_path: Path
) -> Iterator[Callable[[Broker], Celeryland]]:
    """Makes the test's :class:`Celeryland` on a broker; closes it at the end of the test."""
    lands: list[Celeryland] = []

    def make(broker: Broker) -> Celeryland:
        results = brokers.get("results", ResultRedis)
        lands.append(Celeryland(brokers.group, broker, results, local_server, tmp_path))
        return lands[-1]

    yield make
    for land in lands:
        land.close()


@pytest.fixture
def celeryland(broker: Broker, make_land: Callable[[Broker], Celeryland]) -> Celeryland:
    return make_land(broker)


@pytest.fixture
def redisland(redis_broker: Broker, make_land: Callable[[Broker], Celeryland]) -> Celeryland:
    return make_land(redis_broker)


def wait_started(land: Celeryland, task_id: str, timeout: float = 60) -> Callable[[], Any]:
    """Wait until the task's sandbox exists (its job is running); return it."""
    return wait_for(  # type: ignore[no-any-return]
        f"task {task_id}'s sandbox",
        lambda: land.sandboxes(task_id),
        timeout=timeout,
        interval=0.1,
    )[0]
