"""Sandbox tasks on a real ``celery worker``, real Redis and RabbitMQ, a real pandastack-local.

Each test's worker logs what it finished to an events file (tests/celery_tasks/app.py), so "the
result came once" is counted where it happens; the session's leak guard (tests/conftest.py) fails
any test that leaves a sandbox behind.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from celery.result import AsyncResult

from pandastack_celery import SandboxJobFailed
from pandastack_jobs import FailureClass, FailureKind
from pandastack_local.testing.waiting import wait_for
from tests.celery_tasks.conftest import VISIBILITY, Celeryland, Worker, wait_started


def _gone(land: Celeryland, sandbox_id: str) -> bool:
    return all(sb.id != sandbox_id for sb in land.server.client().sandboxes.list())


def events(worker: Worker, what: str, task_id: str, n: int = 1) -> int:
    """How many ``what`` lines the task has, once it has at least ``n`` (the worker writes its line
    after the result is stored, so the caller can see the result first)."""
    wait_for(f"{n} {what} line(s) of {task_id}", lambda: len(worker.lines(what, task_id)) >= n, timeout=10)
    return len(worker.lines(what, task_id))


def test_result_retry_and_dead_letter(celeryland: Celeryland) -> None:
    """The JSON result reaches the result backend; a crash is retried by Celery in a fresh
    sandbox until it succeeds; a permanent exit code fails at once with the job's reason."""
    land = celeryland
    land.worker(concurrency=2)
    ok = land.send("echo", {"a": [1, 2]})
    flaky = land.send("flaky", 2)
    bad = land.send("bad_input", "x;y")
    assert ok.get(timeout=60) == {"x": {"a": [1, 2]}, "task_id": ok.id, "retries": 0}
    assert flaky.get(timeout=60) == 2  # two crashes, each retried, then the result
    assert len(land.workers[0].lines("start", flaky.id)) == 3
    with pytest.raises(SandboxJobFailed) as failed:
        bad.get(timeout=60)
    assert failed.value.failure_class is FailureClass.DEAD_LETTER
    assert failed.value.kind is FailureKind.PERMANENT_EXIT_CODE
    assert "cannot parse 'x;y'" in str(failed.value)
    assert len(land.workers[0].lines("start", bad.id)) == 1  # never retried
    for r in (ok, flaky):
        assert events(land.workers[0], "success", r.id) == 1


def test_worker_sigkill_redelivers_and_reaps(celeryland: Celeryland) -> None:
    """A worker SIGKILLed mid-task (main and pool processes): the broker gives the task to the
    next worker (same task id, same retries), which deletes the dead attempt's sandbox before
    its own; the result comes once."""
    land = celeryland
    first = land.worker(concurrency=1)
    r = land.send("echo", "survivor", seconds=4)
    orphan = wait_started(land, r.id)
    first.kill()
    assert not _gone(land, orphan.id)  # nobody deleted it: the worker died
    second = land.worker(concurrency=1)
    timeout = 60 + (VISIBILITY if land.broker.name == "redis" else 0)
    assert r.get(timeout=timeout) == {"x": "survivor", "task_id": r.id, "retries": 0}
    assert _gone(land, orphan.id)
    assert events(second, "success", r.id) == 1  # the events file is the workers' common log


def test_broker_restart_mid_task(celeryland: Celeryland) -> None:
    """The broker restarts while a task runs: the worker reconnects, the task's result comes
    once, and no sandbox is left (the cancelled attempt's is deleted, by SIGTERM or by reaping)."""
    land = celeryland
    worker = land.worker(concurrency=1)
    r = land.send("echo", "through a restart", seconds=3)
    wait_started(land, r.id)
    land.broker.restart(down_seconds=1)
    assert r.get(timeout=90)["x"] == "through a restart"
    assert events(worker, "success", r.id) == 1
    wait_for("no sandbox of the task", lambda: not land.sandboxes(r.id), timeout=10, interval=0.2)


def test_pool_process_killed_is_requeued(redisland: Celeryland) -> None:
    """The pool process running a task is SIGKILLed (as the OOM killer would): with
    reject_on_worker_lost the message is requeued, the retry reaps the orphan, the result comes once."""
    land = redisland
    worker = land.worker(concurrency=1)
    r = land.send("echo", "again", seconds=4)
    orphan = wait_started(land, r.id)
    pid = int(worker.lines("start", r.id)[0][2])
    os.kill(pid, signal.SIGKILL)
    assert r.get(timeout=60) == {"x": "again", "task_id": r.id, "retries": 0}
    assert _gone(land, orphan.id)
    assert len(worker.lines("start", r.id)) == 2
    assert events(worker, "success", r.id) == 1


def test_a_task_that_kills_its_worker_every_time_fails_past_max_deliveries(redisland: Celeryland) -> None:
    """Every delivery of ``dies`` kills its pool process, so reject_on_worker_lost requeues it
    each time; the worker counts the deliveries in the result backend, and the third one
    (max_deliveries=2) fails at once as a dead-letter instead of looping forever."""
    land = redisland
    worker = land.worker(concurrency=1)
    r = land.send("dies")
    with pytest.raises(SandboxJobFailed) as failed:
        r.get(timeout=60)
    assert failed.value.failure_class is FailureClass.DEAD_LETTER
    assert "delivered 3 times without a result, over max_deliveries=2" in str(failed.value)
    assert len(worker.lines("start", r.id)) == 3  # two ran and died in their worker, the third failed
    assert events(worker, "failure", r.id) == 1
    assert worker.popen.poll() is None
    assert not land.sandboxes(r.id)


def test_memory_hog_beside_honest_tasks(redisland: Celeryland) -> None:
    """A task that eats memory without bound dies in its own sandbox; the honest tasks beside it
    and the worker are untouched."""
    land = redisland
    worker = land.worker(concurrency=4)
    hog = land.send("hog")
    honest = [land.send("echo", i, seconds=1) for i in range(3)]
    assert [h.get(timeout=90)["x"] for h in honest] == [0, 1, 2]
    with pytest.raises(SandboxJobFailed) as failed:
        hog.get(timeout=90)
    assert failed.value.exit_code == 137 or failed.value.kind is FailureKind.SANDBOX_LOST
    assert worker.popen.poll() is None
    assert "WorkerLostError" not in worker.text()


def test_revoke_terminate_deletes_the_sandbox(redisland: Celeryland) -> None:
    """``revoke(terminate=True)`` deletes the running task's sandbox at once; the task is REVOKED."""
    land = redisland
    worker = land.worker(concurrency=1)
    r = land.send("echo", "never", seconds=25)
    sandbox = wait_started(land, r.id)
    started = time.monotonic()
    land.app.control.revoke(r.id, terminate=True)
    wait_for("the sandbox to be deleted", lambda: _gone(land, sandbox.id), timeout=10, interval=0.1)
    assert time.monotonic() - started < 10
    wait_for("REVOKED", lambda: AsyncResult(r.id, app=land.app).state == "REVOKED", timeout=10)
    assert worker.popen.poll() is None
    assert not worker.lines("success", r.id)


def test_soft_time_limit_is_the_guest_clock(redisland: Celeryland) -> None:
    """A task with ``soft_time_limit=5`` whose job would run 30 s: the guest clock stops the job
    before Celery's limit fires, the sandbox is deleted, the task fails at once (not retried)."""
    land = redisland
    worker = land.worker(concurrency=1)
    started = time.monotonic()
    r = land.send("limited", 30)
    with pytest.raises(SandboxJobFailed) as failed:
        r.get(timeout=60)
    assert time.monotonic() - started < 15
    assert failed.value.kind is FailureKind.TIMEOUT
    assert "time limit (5s" in str(failed.value)
    assert "SoftTimeLimitExceeded" not in worker.text()
    assert len(worker.lines("start", r.id)) == 1
    assert not land.sandboxes(r.id)


def test_the_example_app(redisland: Celeryland) -> None:
    """celery_app/tasks.py, as docs/celery.md runs it: a result, and a dead-letter at once."""
    land = redisland
    land.worker(concurrency=2, module="celery_app.tasks")
    counted = land.send("celery_app.tasks.word_count", "a b a")
    rows = [{"t": 1.0}, {"t": 3.0}]
    summary = land.send("celery_app.tasks.summarize", rows, "t")
    missing = land.send("celery_app.tasks.summarize", rows, "nope")
    assert counted.get(timeout=60) == {"a": 2, "b": 1}
    assert summary.get(timeout=60) == {"mean": 2.0, "max": 3.0, "rows": 2}
    with pytest.raises(SandboxJobFailed, match="no row has the column 'nope'") as failed:
        missing.get(timeout=60)
    assert failed.value.failure_class is FailureClass.DEAD_LETTER
