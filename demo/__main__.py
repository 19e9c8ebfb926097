"""``make demo``: start the local server, run the three DAGs and the three flows, print a table,
then run the queue example (twenty messages on a Redis the demo starts and stops)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from pandastack_jobs import ConnectionConfig
from pandastack_local import LocalServer

from .airflow_runner import DAGS, airflow_env, prepare, run_dag
from .expectations import Row, chart_problem, format_table, surprises
from .prefect_runner import ROWS_MARKER
from .queue_demo import QueueSummary
from .queue_demo import main as queue_demo

ROOT = Path(__file__).resolve().parent.parent
STATE = ROOT / ".demo"
PREFECT_PYTHON = ROOT / ".venv-prefect" / "bin" / "python"


def say(text: str) -> None:
    print(text, flush=True)


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C: the Redis and the server are stopped


def main() -> int:
    signal.signal(signal.SIGTERM, _terminated)
    if STATE.exists():
        shutil.rmtree(STATE)
    logs = STATE / "logs"
    logs.mkdir(parents=True)
    reports = STATE / "reports"
    rows: list[Row] = []
    started = time.monotonic()
    say("Starting the embedded PandaStack server (pandastack_local) ...")
    with LocalServer(state_dir=str(STATE / "server")) as server:
        say(f"  {server.url} (real isolation: namespaces + cgroups; logs in {logs})")
        env = airflow_env(STATE / "airflow", server.url, server.api_key, f"file://{reports}/airflow")
        say("Airflow: creating the SQLite metadata DB and the sandbox pool ...")
        prepare(env)
        for i, dag_id in enumerate(DAGS, 1):
            say(f"[airflow {i}/{len(DAGS)}] airflow dags test {dag_id} ...")
            rows.extend(run_dag(dag_id, env, logs / f"airflow-{dag_id}.log"))
        say("Prefect: running the flows on an ephemeral server ...")
        penv = dict(os.environ)
        penv.update(server.env())
        penv.update(
            {
                "PREFECT_HOME": str(STATE / "prefect"),
                "PREFECT_INTEGRATIONS_PANDASTACK_FILES_DIR": str(reports / "prefect" / "files"),
                "PANDASTACK_DEMO_REPORTS": str(reports / "prefect"),
                "PREFECT_LOGGING_LEVEL": "WARNING",
            }
        )
        found: list[Row] | None = None
        with (logs / "prefect.log").open("w") as log:
            runner = subprocess.Popen(
                [str(PREFECT_PYTHON), "-m", "demo.prefect_runner"],
                env=penv,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
            assert runner.stdout is not None
            for line in runner.stdout:
                if line.startswith(ROWS_MARKER):
                    found = json.loads(line[len(ROWS_MARKER) :])
                else:
                    say(line.rstrip())
            returncode = runner.wait()
        if returncode != 0 or found is None:
            say(f"Prefect runner failed (exit {returncode}); see {logs / 'prefect.log'}")
            rows.append(
                {
                    "engine": "prefect",
                    "job": "flows",
                    "outcome": "failed",
                    "reason": f"runner exit {returncode}",
                    "seconds": 0.0,
                }
            )
        else:
            rows.extend(found)
        say("Queue: the core consumer on a real Redis stream ...")
        queue: QueueSummary | None = None
        queue_error = ""
        try:
            queue = queue_demo(logs, ConnectionConfig(api_url=server.url, api_key=server.api_key), say)
        except RuntimeError as exc:  # no redis-server and no way to install it, or it did not start
            queue_error = str(exc)
        leftovers = server.client().sandboxes.list()
    say("")
    say(format_table(rows))
    say("")
    say(f"Reports: Airflow (object storage)        -> {reports / 'airflow'}")
    say(f"         Prefect (artifact, read back)   -> {reports / 'prefect' / 'report.md'}")
    charts = sorted(reports.rglob("chart.png"))  # matplotlib in the sandbox, stored by each engine
    for i, chart in enumerate(charts):
        say(f"{'Charts (PNG)' if i == 0 else '':<41}-> {chart}")
    say("")
    say("Queue (Redis stream, one sandbox per message, acked only after its result is out):")
    for line in queue.lines() if queue is not None else [f"not run: {queue_error}"]:
        say(f"  {line}")
    say("")
    say(f"Logs: {logs}")
    say(f"Sandboxes left on the server: {len(leftovers)}. Total {time.monotonic() - started:.0f} s.")
    problems = surprises(rows)
    if len(charts) < 2:
        problems.append(f"expected the report's chart from both engines, found {len(charts)}")
    for chart in charts:
        problem = chart_problem(chart.read_bytes())
        if problem:
            problems.append(f"{chart}: {problem}")
    problems.extend(f"queue: {p}" for p in (queue.problems if queue is not None else [queue_error]))
    if leftovers:
        problems.append(f"{len(leftovers)} sandbox(es) left behind")
    if problems:
        say("UNEXPECTED:\n  " + "\n  ".join(problems))
        return 1
    say(
        "Every job ended as expected: hostile tenants failed alone, everything else succeeded; "
        "every queue message was acked or dead-lettered as it should."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
