"""Flows the process-level tests run in a subprocess (importable by module path)."""

from __future__ import annotations

from prefect import flow

from prefect_blocks import run_in_sandbox, sandbox_cleanup_hook

# The job is the same on every attempt (same command, files, input: same job id);
# how long it sleeps comes from the environment, so a retry can finish quickly.
JOB = "sleep ${JOB_SLEEP:-0}; echo '{\"done\": true}' > /work/result.json"


@flow(name="killed-worker-flow")
def killed_worker_flow(sleep: int = 0) -> object:
    return run_in_sandbox(command=JOB, env={"JOB_SLEEP": str(sleep)}, timeout=120)


cleanup = sandbox_cleanup_hook()


@flow(name="cancellable-flow", on_cancellation=[cleanup], on_crashed=[cleanup])
def cancellable_flow(sleep: int = 0) -> object:
    return run_in_sandbox(command=JOB, env={"JOB_SLEEP": str(sleep)}, timeout=120)
