"""pandastack_celery: Celery tasks whose body runs in one throwaway PandaStack sandbox each.

``@sandbox_task(app)`` (or ``@app.task(base=SandboxTask)``) makes a task that runs the function's
own source as one job of the core (:func:`pandastack_jobs.run_job`): JSON in, JSON out, acked
after the result is stored, retried in a fresh sandbox only when that may help. docs/celery.md.
"""

from .versions import check_celery

check_celery()

from .exceptions import PandaStackCeleryError, SandboxJobFailed, SandboxTaskConfigError  # noqa: E402
from .task import SANDBOX_SETTINGS, SandboxTask, guest_clock, sandbox_task  # noqa: E402

__all__ = [
    "SANDBOX_SETTINGS",
    "PandaStackCeleryError",
    "SandboxJobFailed",
    "SandboxTask",
    "SandboxTaskConfigError",
    "guest_clock",
    "sandbox_task",
]
