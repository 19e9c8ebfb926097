# ruff: noqa: E402  (the version check runs before the imports)
"""Prefect blocks and tasks that run each job in its own throwaway PandaStack sandbox.

::

    from prefect import flow
    from prefect_blocks import run_in_sandbox

    @flow
    def transform(rows):
        return run_in_sandbox(command="python3 run.py", files={"run.py": CODE}, input={"rows": rows})

The lifecycle, failure classification and orphan reaping are
``pandastack_jobs``'; this package translates them into Prefect blocks, tasks,
retries, hooks and artifacts. Registered with ``prefect block register -m prefect_blocks``
and the ``prefect.collections`` entry point.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from pandastack_workflows.moved import register

from .versions import check_prefect

check_prefect()  # before Prefect is imported: an unsupported one fails here, naming the range

from .cleanup import sandbox_cleanup_hook, sweep_flow_run
from .credentials import PandaStackCredentials
from .exceptions import PandaStackPrefectError, SandboxJobFailed
from .forkpool import WarmParent, run_in_fork, warm_pool
from .retries import REDELIVERY_DELAY, Backoff, make_retry_condition, retry_on_redeliver
from .sandbox import PandaStackSandbox, PandaStackSandboxRun
from .tasks import arun_in_sandbox, run_in_sandbox, sandbox_task

register({"prefect_blocks.errors": "prefect_blocks.exceptions"})

try:
    __version__ = version("pandastack-workflows")
except PackageNotFoundError:  # a checkout on sys.path without an install
    __version__ = "0.0.0"

__all__ = [
    "REDELIVERY_DELAY",
    "Backoff",
    "PandaStackCredentials",
    "PandaStackPrefectError",
    "PandaStackSandbox",
    "PandaStackSandboxRun",
    "SandboxJobFailed",
    "WarmParent",
    "arun_in_sandbox",
    "make_retry_condition",
    "retry_on_redeliver",
    "run_in_fork",
    "run_in_sandbox",
    "sandbox_cleanup_hook",
    "sandbox_task",
    "sweep_flow_run",
    "warm_pool",
]
