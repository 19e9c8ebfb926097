"""DAGs for e2e/test_airflow_pandastack_executor.py (scheduler with CeleryExecutor and
PandaStackExecutor on PostgreSQL). Plain Airflow tasks, no PandaStack code: each reports what
only the inside of its sandbox knows (the id the driver wrote there, the hostname, PID 1) and
tries to leave a marker file in a host directory (the run's conf ``marker_dir``): on the host
the marker appears, in a sandbox it lands in the sandbox's own throwaway filesystem."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

from airflow.providers.standard.operators.bash import BashOperator
from airflow.providers.standard.operators.python import PythonOperator
from airflow.sdk import Variable, dag, get_current_context, task

PANDASTACK = "PandaStackExecutor"
SANDBOX_ID = "/work/.pandastack/sandbox_id"
# The same three facts from a shell (double quotes dropped from PID 1's argv: the line is JSON).
WHERE_SH = (
    f'printf \'{{"sandbox_id": "%s", "hostname": "%s", "pid1": "%s"}}\\n\' '
    f'"$(cat {SANDBOX_ID} 2>/dev/null)" "$(hostname)" "$(tr -d \'"\' </proc/1/cmdline | tr \'\\0\' \' \')"'
)
MARKER_DIR = "{{ dag_run.conf['marker_dir'] }}"
MARK_SH = f"mkdir -p {MARKER_DIR} && touch {MARKER_DIR}/{{{{ ti.task_id }}}}"


def where(task_id: str) -> dict[str, Any]:
    """Where this code runs; leaves ``<marker_dir>/<task_id>`` behind (seen only if that is the host)."""
    marker_dir = Path(get_current_context()["dag_run"].conf["marker_dir"])
    marker_dir.mkdir(parents=True, exist_ok=True)
    (marker_dir / task_id).write_text(str(os.getpid()))
    sid = Path(SANDBOX_ID)
    return {
        "sandbox_id": sid.read_text() if sid.exists() else None,
        "hostname": socket.gethostname(),
        "pid1": Path("/proc/1/cmdline").read_bytes().replace(b"\0", b" ").decode(),
    }


@dag(dag_id="e2e_executor_plain", schedule=None, catchup=False, default_args={"executor": PANDASTACK})
def e2e_executor_plain() -> None:
    @task
    def decorated() -> dict[str, Any]:
        return where("decorated")

    decorated()
    PythonOperator(task_id="python_op", python_callable=where, op_args=["python_op"])
    BashOperator(task_id="bash_op", bash_command=f"{MARK_SH}; {WHERE_SH}")


@dag(dag_id="e2e_executor_mixed", schedule=None, catchup=False)
def e2e_executor_mixed() -> None:
    @task  # the default executor: CeleryExecutor
    def produce() -> dict[str, Any]:
        return {"n": 21, "where": where("produce")}

    @task(executor=PANDASTACK)
    def double(got: dict[str, Any]) -> dict[str, Any]:
        return {"n": got["n"] * 2, "where": where("double")}

    @task
    def consume(got: dict[str, Any]) -> dict[str, Any]:
        return {"n": got["n"], "where": where("consume")}

    consume(double(produce()))


def _wait_for_release(limit: float = 300) -> dict[str, Any]:
    """Count this start in a Variable, then wait until the test sets the release Variable."""
    ctx = get_current_context()
    key = f"{ctx['run_id']}__{ctx['ti'].task_id}"
    starts = int(Variable.get(f"e2e_starts__{key}", default="0")) + 1
    Variable.set(f"e2e_starts__{key}", str(starts))
    deadline = time.monotonic() + limit
    while Variable.get(f"e2e_release__{key}", default=None) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"never released ({key})")
        time.sleep(1)
    return {"starts": starts, "where": where(ctx["ti"].task_id)}


@dag(
    dag_id="e2e_executor_hold",
    schedule=None,
    catchup=False,
    default_args={"executor": PANDASTACK, "retries": 0},
)
def e2e_executor_hold() -> None:
    """Tasks that run until the test releases them (kill and scheduler-restart checks)."""
    for name in ("held_a", "held_b"):
        task(task_id=name)(_wait_for_release)()


e2e_executor_plain()
e2e_executor_mixed()
e2e_executor_hold()
