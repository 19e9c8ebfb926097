"""Run by PandaStackExecutor with ``warm_pool_size`` in tests/airflow/test_airflow_executor_warm.py:
a plain task reporting which sandbox it ran in, what its parent process is (under a standby's
runner the Task SDK's supervisor is the runner's fork, so its command line is the runner's) and
every process's environment (the test searches it for the scheduler's secrets)."""

from __future__ import annotations

import os
from pathlib import Path

from airflow.sdk import dag, task

SANDBOX_ID = "/work/.pandastack/sandbox_id"


@dag(dag_id="pandastack_executor_warm", schedule=None, catchup=False)
def pandastack_executor_warm() -> None:
    @task
    def where() -> dict[str, str]:
        parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode()

        def environ_of(proc: Path) -> str | None:
            try:
                return (proc / "environ").read_bytes().decode(errors="replace")
            except OSError:  # gone meanwhile
                return None

        # Every process's environment: the standby's runner's and the try's.
        procs = [entry for entry in Path("/proc").iterdir() if entry.name.isdigit()]
        environ = [text for text in map(environ_of, procs) if text is not None]
        return {"sandbox_id": Path(SANDBOX_ID).read_text(), "parent": parent, "environ": environ}

    where()


pandastack_executor_warm()
