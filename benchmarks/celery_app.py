"""The Celery app of ``benchmarks.celery``: the same ~30 ms Python job as a plain task (run in the
pool process, what Celery users run today) and as a sandbox task (one fresh sandbox per call).

Configured by the environment the benchmark gives its workers (``BENCH_CELERY_BROKER``,
``BENCH_CELERY_BACKEND``; the PandaStack server in ``PANDASTACK_API``/``PANDASTACK_API_KEY``).
"""

from __future__ import annotations

import os

from celery import Celery

from pandastack_celery import SANDBOX_SETTINGS, sandbox_task

app = Celery("bench")
app.conf.update(SANDBOX_SETTINGS)
app.conf.update(
    broker_url=os.environ.get("BENCH_CELERY_BROKER", "memory://"),
    result_backend=os.environ.get("BENCH_CELERY_BACKEND", "cache+memory://"),
    task_acks_late=True,  # the plain task acks as the sandboxed one does: after its result
)

ITERATIONS = 400_000  # about 30 ms of CPython on this project's 2-core machines


def job(rows: list[int], iterations: int) -> dict[str, int]:
    """Sum the rows after ~30 ms of arithmetic (the same body in both tasks)."""
    spin = 0
    for i in range(iterations):
        spin += i & 7
    return {"total": sum(rows), "n": len(rows), "spin": spin}


@app.task(name="bench.plain")
def plain(rows: list[int], iterations: int) -> dict[str, int]:
    return job(rows, iterations)


@sandbox_task(app, name="bench.sandboxed", template="base", timeout=60)
def sandboxed(rows: list[int], iterations: int) -> dict[str, int]:
    spin = 0
    for i in range(iterations):
        spin += i & 7
    return {"total": sum(rows), "n": len(rows), "spin": spin}
