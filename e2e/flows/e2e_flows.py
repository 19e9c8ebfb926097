"""E2E-only flow (not an example): one slow sandbox job, for the worker-kill and cancel scenarios.

Credentials come from the PandaStackCredentials block saved on the server by
``e2e/prefect_setup.py``; cancellation and crash hooks sweep the run's sandboxes.
"""

from __future__ import annotations

import os
from typing import Any

from prefect import flow

from e2e.jobcode import SLOW_JOB
from prefect_blocks import PandaStackCredentials, run_in_sandbox, sandbox_cleanup_hook


def _credentials() -> PandaStackCredentials:
    return PandaStackCredentials.load(os.environ.get("E2E_PANDASTACK_BLOCK", "e2e-local"))


def _sweep(flow_: Any, flow_run: Any, state: Any) -> None:
    sandbox_cleanup_hook(_credentials())(flow_, flow_run, state)


@flow(name="e2e-sandbox-job", on_cancellation=[_sweep], on_crashed=[_sweep])
def sandbox_job(seconds: float = 20, value: int = 21) -> Any:
    return run_in_sandbox(
        command="python3 job.py",
        files={"job.py": SLOW_JOB},
        input={"seconds": seconds, "value": value},
        credentials=_credentials(),
        timeout=120,
        job_name="slow-job",
    )
