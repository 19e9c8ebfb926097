"""Run by PandaStackExecutor in tests/airflow/test_airflow_executor_scheduler.py: plain tasks, no
PandaStack code. Each reports what only the inside of its sandbox knows (the id the driver wrote
there, the sandbox's hostname and PID 1), and one gathers the sandbox's environment and files so
the test can search them for secrets."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from airflow.providers.standard.operators.bash import BashOperator
from airflow.providers.standard.operators.python import PythonOperator
from airflow.sdk import dag, task

SANDBOX_ID = "/work/.pandastack/sandbox_id"
SKIP = ("/proc", "/sys", "/usr", "/dev")
MAX_BYTES = 2 * 1024 * 1024


def where() -> dict[str, str]:
    return {
        "sandbox_id": Path(SANDBOX_ID).read_text(),
        "hostname": socket.gethostname(),
        "pid1": Path("/proc/1/cmdline").read_bytes().replace(b"\0", b" ").decode(),
    }


def gather() -> dict[str, object]:
    """Every process's environment and every file in the sandbox's writable directories, as text."""
    environ = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ.append((entry / "environ").read_bytes().decode(errors="replace"))
            except OSError:
                pass
    files: dict[str, str] = {}
    budget = MAX_BYTES
    for root, dirs, names in os.walk("/"):
        # Read-only binds are the host's /usr, the workers' venv and the DAG code: not the sandbox's own.
        if root.startswith(SKIP) or not os.access(root, os.W_OK):
            dirs[:] = []
            continue
        for name in names:
            path = Path(root) / name
            try:
                if path.is_file() and not path.is_symlink() and path.stat().st_size <= budget:
                    data = path.read_bytes()
                    budget -= len(data)
                    files[str(path)] = data.decode(errors="replace")
            except OSError:
                pass
    return {"environ": environ, "files": files, "where": where()}


@dag(dag_id="pandastack_executor_try", schedule=None, catchup=False)
def pandastack_executor_try() -> None:
    @task
    def decorated() -> dict[str, str]:
        return where()

    decorated()
    PythonOperator(task_id="python_op", python_callable=where)
    BashOperator(task_id="bash_op", bash_command=f"hostname; cat {SANDBOX_ID}")
    PythonOperator(task_id="secrets_probe", python_callable=gather)
    BashOperator(task_id="fails", bash_command="echo last words before failing; exit 3", retries=0)


pandastack_executor_try()
