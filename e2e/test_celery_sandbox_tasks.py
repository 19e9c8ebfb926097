"""A sandbox task (pandastack_celery) through a real ``celery worker`` of the Celery venv
(``.venv-celery``, its own Celery), on the e2e Redis and the e2e PandaStack server: its first
delivery crashes in its sandbox, Celery's own retry runs it again in a fresh sandbox, and the
second delivery's result is the task's one result.

The worker runs the Celery tests' app (tests/celery_tasks/app.py, task ``flaky``), which logs
each start, success and failure to an events file; the client side is the Airflow venv's Celery.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from celery import Celery

from pandastack_local.testing.waiting import wait_for

from .celery_worker import Worker
from .procs import ProcessGroup
from .services import REPO, PandaStack, Redis

CE = REPO / ".venv-celery"
# Databases of the e2e Redis: 0 is Airflow's Celery broker, 1 the queue streams (queue_checks.py).
BROKER_DB, RESULTS_DB = 2, 3

pytestmark = pytest.mark.timeout(300)


def test_a_celery_task_fails_once_then_succeeds_in_a_fresh_sandbox(
    group: ProcessGroup, redis: Redis, pandastack: PandaStack, run_dir: Path
) -> None:
    python = CE / "bin" / "python"
    assert python.exists(), f"{python} is missing: make .venv-celery/.installed (e2e/run.sh does)"
    queue = f"e2e-celery-{uuid.uuid4().hex[:8]}"
    broker = f"redis://127.0.0.1:{redis.port}/{BROKER_DB}"
    backend = f"redis://127.0.0.1:{redis.port}/{RESULTS_DB}"
    events = run_dir / f"{queue}.events"
    env = {
        **os.environ,
        **pandastack.env(),
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",
        "CELERY_TEST_BROKER": broker,
        "CELERY_TEST_BACKEND": backend,
        "CELERY_TEST_QUEUE": queue,
        "CELERY_TEST_EVENTS": str(events),
    }
    argv = [str(python), "-m", "celery", "-A", "tests.celery_tasks.app", "worker", "--loglevel", "INFO"]
    argv += ["--pool", "prefork", "--concurrency", "1", "--hostname", f"{queue}@%h"]
    argv += ["--without-gossip", "--without-mingle", "--queues", queue]
    app = Celery("e2e-client", broker=broker, backend=backend, set_as_current=False)
    with group.stopping("sandbox-celery-"):
        worker = Worker(group, f"sandbox-celery-{queue}", argv, env, events)
        r = app.send_task("tests.celery_tasks.app.flaky", args=(1,), queue=queue)
        try:
            assert r.get(timeout=120) == 1, worker.text()[-4000:]  # the retry count it succeeded on
        finally:
            app.close()
        # Both attempts ran (the first crashed, Celery retried it), one result, no failure.
        assert len(worker.lines("start", r.id)) == 2, events.read_text()
        # The worker writes its success line just after storing the result.
        wait_for("the success line", lambda: worker.lines("success", r.id), timeout=10, interval=0.1)
        assert len(worker.lines("success", r.id)) == 1, events.read_text()
        assert worker.lines("failure", r.id) == []
        assert pandastack.engine_sandboxes("celery") == []
