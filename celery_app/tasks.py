"""An example Celery app: each task's body runs in a fresh PandaStack sandbox (docs/celery.md).

Run a worker and send a task (a Redis on 127.0.0.1:6379, or set CELERY_BROKER_URL and
CELERY_RESULT_BACKEND; PANDASTACK_API and PANDASTACK_API_KEY name the PandaStack server)::

    celery -A celery_app.tasks worker --pool prefork --concurrency 4 --loglevel INFO
    python -c "from celery_app.tasks import word_count; print(word_count.delay('a b a').get(timeout=60))"
"""

from __future__ import annotations

import os

from celery import Celery

from pandastack_celery import SANDBOX_SETTINGS, sandbox_task

app = Celery(
    "celery_app",
    broker=os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0"),
    backend=os.environ.get("CELERY_RESULT_BACKEND", "redis://127.0.0.1:6379/1"),
)
# JSON only, one task per pool process at a time, and on a lost broker connection the running
# tasks are cancelled (their sandboxes deleted) and redelivered instead of finishing unacked.
app.conf.update(SANDBOX_SETTINGS)


@sandbox_task(app, template=os.environ.get("EXAMPLE_TEMPLATE", "code-interpreter"), timeout=60)
def word_count(text: str) -> dict[str, int]:
    """Runs in the sandbox: count the words of ``text`` (untrusted input, untrusted parsing)."""
    from collections import Counter

    return dict(Counter(text.split()))


@sandbox_task(
    app,
    template=os.environ.get("EXAMPLE_TEMPLATE", "code-interpreter"),
    timeout=120,
    permanent_exit_codes=[3],  # the input can never succeed: fail at once, no retry
    max_retries=5,  # a crash or a lost sandbox: retried in a fresh sandbox
    soft_time_limit=90,  # the job's guest clock stops it 9 s before this
)
def summarize(rows: list[dict[str, float]], column: str) -> dict[str, float]:
    """Runs in the sandbox: the mean and the max of one column of ``rows``."""
    import sys

    values = [row[column] for row in rows if column in row]
    if not values:
        print(f"no row has the column {column!r}", file=sys.stderr)
        sys.exit(3)
    return {"mean": sum(values) / len(values), "max": max(values), "rows": len(values)}
