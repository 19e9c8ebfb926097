"""The Celery app of ``benchmarks.celery``: the same ~30 ms Python job as a plain task (run in the
pool process, what Celery users run today) and as a sandbox task (one fresh sandbox per call).

Configured by the environment the benchmark gives its workers (``BENCH_CELERY_BROKER``,
``BENCH_CELERY_BACKEND``; the PandaStack server in ``PANDASTACK_API``/``PANDASTACK_API_KEY``).
"""

from __future__ import annotations

import os

from celery import Celery

from benchmarks.common import JOB_TIMEOUT, WORKER_TEMPLATE, spin_job
from pandastack_celery import SANDBOX_SETTINGS, sandbox_task

app = Celery("bench")
app.conf.update(SANDBOX_SETTINGS)
app.conf.update(
    broker_url=os.environ.get("BENCH_CELERY_BROKER", "memory://"),
    result_backend=os.environ.get("BENCH_CELERY_BACKEND", "cache+memory://"),
    task_acks_late=True,  # the plain task acks as the sandboxed one does: after its result
)


@app.task(name="bench.plain")
def plain(rows: list[int], iterations: int) -> dict[str, int]:
    """The job in the pool process."""
    return spin_job(rows, iterations)


# The same function's source runs in a fresh sandbox per call.
sandboxed = sandbox_task(app, name="bench.sandboxed", template=WORKER_TEMPLATE, timeout=JOB_TIMEOUT)(spin_job)
