"""The Celery app of the Celery tests: a real ``celery worker`` imports it (``-A
tests.celery_tasks.app``), configured by the environment the fixtures give it.

Every task is a sandbox task; their bodies run in the sandbox, so each imports what it needs.
The worker appends one line per finished task to ``$CELERY_TEST_EVENTS`` (``success <id>`` or
``failure <id>``, and ``start <id> <pid>`` when a pool process starts one): how the tests count
that a result came once and find the pool process to kill.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from celery import Celery, signals

from pandastack_celery import SANDBOX_SETTINGS, SandboxTask, sandbox_task

app = Celery("sandboxed")
app.conf.update(SANDBOX_SETTINGS)
app.conf.update(
    broker_url=os.environ.get("CELERY_TEST_BROKER", "memory://"),
    result_backend=os.environ.get("CELERY_TEST_BACKEND", "cache+memory://"),
    task_default_queue=os.environ.get("CELERY_TEST_QUEUE", "celery"),
    # A SIGKILLed worker's Redis message comes back after the visibility timeout (every test task
    # is shorter), found by a sweep each second (kombu's default: every 100 s).
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("CELERY_TEST_VISIBILITY", "10")),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    broker_connection_retry_on_startup=True,
    task_track_started=True,
)

JOB = {"template": "base", "timeout": 30}


@sandbox_task(app, **JOB)
def echo(x: Any, seconds: float = 0) -> dict[str, Any]:
    import os
    import time

    time.sleep(seconds)
    return {"x": x, "task_id": os.environ["CELERY_TASK_ID"], "retries": int(os.environ["CELERY_RETRIES"])}


@sandbox_task(app, **JOB, max_retries=3, default_retry_delay=1)
def flaky(fail_times: int) -> int:
    import os
    import sys

    retries = int(os.environ["CELERY_RETRIES"])
    if retries < fail_times:
        print(f"crash on retry {retries}", file=sys.stderr)
        sys.exit(1)
    return retries


@sandbox_task(app, **JOB, permanent_exit_codes=[3])
def bad_input(value: str) -> None:
    import sys

    print(f"cannot parse {value!r}", file=sys.stderr)
    sys.exit(3)


@sandbox_task(app, template="base", timeout=30, max_retries=0)
def hog() -> None:
    blocks = []
    while True:
        blocks.append(bytearray(64 << 20))


@sandbox_task(app, **JOB, soft_time_limit=5)
def limited(seconds: float) -> str:
    import time

    time.sleep(seconds)
    return "done"


class DiesInItsWorker(SandboxTask):
    """Kills its own pool process once its job has run, before the result is stored: a worker
    fault that strikes every delivery of the task (a crashing native library, the OOM killer)."""

    def settle(self, outcome: Any, limit: Any = None) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)


@app.task(base=DiesInItsWorker, job_options=dict(JOB), max_deliveries=2)
def dies() -> None:
    return None


def _event(line: str) -> None:
    path = os.environ.get("CELERY_TEST_EVENTS")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


@signals.task_prerun.connect
def _started(task_id: str = "", **_: Any) -> None:
    _event(f"start {task_id} {os.getpid()}")


@signals.task_success.connect
def _succeeded(sender: Any = None, **_: Any) -> None:
    _event(f"success {sender.request.id}")


@signals.task_failure.connect
def _failed(task_id: str = "", **_: Any) -> None:
    _event(f"failure {task_id}")
