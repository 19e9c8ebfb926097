"""(issue 17 item 7, issue 27 item 3) Per-task overhead of ``PandaStackExecutor``, cold and warm,
against ``LocalExecutor``.

``python -m benchmarks.executor [--tasks N] [--rounds R] [--warm-pool-size S]`` (in ``.venv-airflow``).
One scheduler with ``executor = LocalExecutor,PandaStackExecutor:airflow_provider.executors.
PandaStackExecutor`` and ``[pandastack_executor] warm_pool_size = S`` (default N) on SQLite, one
api-server, one pandastack-local (the workers' venv as template, egress to the api-server only), and the same
trivial ``@task`` DAGs on three legs: ``local`` (LocalExecutor), ``cold`` (PandaStackExecutor with
a task env in the import environment, ``PYTHON_BENCH_LEG``, which keeps it off the standbys: the
cold path exactly) and ``warm`` (a ready standby, the bench waits for the pool to be full before
each warm run). Each leg runs one try at a time (``one``) and N at once (``six``); runs alternate
(after one warm-up run of each), so machine drift hits every leg alike.

Every figure comes from timestamps one can observe: the TI's ``queued_dttm``, ``start_date``
(the task runner's first Execution API call, i.e. Airflow is up inside the process/sandbox) and
``end_date``; the workload's launch time inside the sandbox (``started_at`` of the handle the
executor persists in ``external_executor_id``, which also says whether the try ran warm); and
when the sandbox disappears from the server's list (a 0.2 s sampler). Per PandaStack try:
queued -> launched = pick-up + sandbox create (or standby take) + the id file; launched -> start
= Airflow start-up inside the sandbox (cold: interpreter, imports, DAG parse; warm: the fork and
the DAG parse); start -> end = the task with its Execution API round trips through the egress
relay; end -> gone = log copy-back and delete. The load average is printed at the start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from airflow_provider.executors.models import SandboxExecutionRef
from airflow_provider.executors.pandastack_executor import ALIAS_CONFIG
from benchmarks.common import log, machine, ratio, summary, write_json
from pandastack_jobs.warm_start import CHECK_COMMAND, PID_PATH
from pandastack_local.testing.executor_stack import ExecutorStack, start_executor_stack

ROOT = Path(__file__).resolve().parent.parent
DAG = """
from airflow.sdk import dag, task

# cold: a task env in the import environment (PYTHON*) splits it from the standbys' key, so it
# launches cold exactly as with warm_pool_size = 0 (the variable itself changes nothing).
LEGS = {{
    "local": ("LocalExecutor", None),
    "cold": ("PandaStackExecutor", {{"pandastack": {{"env": {{"PYTHON_BENCH_LEG": "cold"}}}}}}),
    "warm": ("PandaStackExecutor", None),
}}
for name, (executor, config) in LEGS.items():
    for shape, n in (("one", 1), ("six", {n})):
        args = {{"executor": executor}}
        if config:
            args["executor_config"] = config

        @dag(dag_id=f"bench_{{name}}_{{shape}}", schedule=None, catchup=False, default_args=args)
        def bench():
            for i in range(n):

                @task(task_id=f"t{{i}}")
                def trivial():
                    return 1

                trivial()

        bench()
"""
KINDS = ("local", "cold", "warm")
SHAPES = ("one", "six")
STANDBY_LABEL = "pandastack.standby"


def _epoch(value: str | None) -> float | None:
    if not value:
        return None
    when = datetime.fromisoformat(value)
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


class Gone:
    """When each sandbox was last listed by the server (sandbox id -> epoch seconds); the standbys."""

    def __init__(self, stack: ExecutorStack) -> None:
        self.client = stack.server.client()
        self.last_seen: dict[str, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.stop.is_set():
            now = time.time()
            try:
                for sb in self.client.sandboxes.list():
                    self.last_seen[sb.id] = now
            except Exception as exc:
                log(f"executor bench: sampler: {exc}")
            self.stop.wait(0.2)

    def tries(self) -> int:
        """Live sandboxes that are not idle standbys (a taken standby runs a try, but is not
        told apart here: the bench waits for the standby count instead)."""
        return sum(1 for sb in self.client.sandboxes.list() if STANDBY_LABEL not in (sb.metadata or {}))

    def standbys(self) -> list[str]:
        return [sb.id for sb in self.client.sandboxes.list() if STANDBY_LABEL in (sb.metadata or {})]


def wait_standbys_ready(stack: ExecutorStack, size: int, limit: float = 300) -> None:
    """Until ``size`` standbys exist with their runner listening (a pool refills in the
    background after each warm run: the next warm run should find it full)."""
    client = stack.server.client()
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        standbys = [sb for sb in client.sandboxes.list() if STANDBY_LABEL in (sb.metadata or {})]
        if len(standbys) >= size and all(_ready(sb) for sb in standbys):
            return
        time.sleep(0.5)
    log("executor bench: the standby pool did not fill in time; the warm run may go partly cold")


def _ready(sb: Any) -> bool:
    try:
        res = sb.exec(CHECK_COMMAND, timeout_seconds=30)  # the pool's own liveness check
    except Exception:
        return False
    return res.exit_code == 0


def one_run(stack: ExecutorStack, gone: Gone, kind: str, shape: str, size: int) -> dict[str, Any]:
    dag_id = f"bench_{kind}_{shape}"
    if kind == "warm":
        wait_standbys_ready(stack, size)
    run_id = stack.trigger(dag_id)
    assert stack.wait_run(dag_id, run_id, timeout=900) == "success", stack.log_tail("scheduler")
    rows = stack.query(
        "select queued_dttm, start_date, end_date, external_executor_id from task_instance "
        "where dag_id=? and run_id=?",
        dag_id,
        run_id,
    )
    refs = [SandboxExecutionRef.decode(row[3], expected_driver="pandastack") for row in rows]
    if kind != "local":  # every try's sandbox deleted: the cleanup is part of the cost
        ids = {ref.handle.data["sandbox_id"] for ref in refs if ref is not None}
        deadline = time.monotonic() + 120
        while ids & {sb.id for sb in gone.client.sandboxes.list()} and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)
    (run_start, run_end) = stack.query(
        "select start_date, end_date from dag_run where dag_id=? and run_id=?", dag_id, run_id
    )[0]
    tis = []
    for (queued, start, end, _), ref in zip(rows, refs, strict=True):
        ti: dict[str, Any] = {"queued": _epoch(queued), "start": _epoch(start), "end": _epoch(end)}
        if ref is not None:
            ti["launched"] = float(ref.handle.data["started_at"])
            ti["warm"] = bool(ref.handle.data.get("standby"))
            seen = gone.last_seen.get(str(ref.handle.data["sandbox_id"]))
            ti["gone"] = seen + 0.1 if seen else None
        tis.append(ti)
    wall = (_epoch(run_end) or 0) - (_epoch(run_start) or 0)
    return {"tis": tis, "wall_s": wall}


def spans(tis: list[dict[str, Any]], a: str, b: str) -> list[float]:
    return [t[b] - t[a] for t in tis if t.get(a) is not None and t.get(b) is not None]


def p50_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 1) if values else float("nan")


def standby_rss_mib(stack: ExecutorStack) -> dict[str, list[float]]:
    """Each idle standby's memory: the runner's RSS (the Task SDK imported) and the RSS of every
    process in the sandbox (the runner and the sandbox's agent), from its own /proc."""
    out: dict[str, list[float]] = {"runner": [], "sandbox": []}
    client = stack.server.client()
    for sb in client.sandboxes.list():
        if STANDBY_LABEL not in (sb.metadata or {}):
            continue
        res = sb.exec(
            f"awk '/^VmRSS:/ {{print $2}}' /proc/$(cat {PID_PATH})/status; "
            "awk '/^VmRSS:/ {s += $2} END {print s}' /proc/[0-9]*/status 2>/dev/null",
            timeout_seconds=30,
        )
        lines = (res.stdout or "")[:64].split()
        if len(lines) == 2 and all(x.isdigit() for x in lines):
            out["runner"].append(round(int(lines[0]) / 1024, 1))
            out["sandbox"].append(round(int(lines[1]) / 1024, 1))
    return out


def measure(tasks: int, rounds: int, size: int) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="bench-executor-"))
    dags = home / "dags"
    dags.mkdir(parents=True)
    (dags / "bench_executor.py").write_text(DAG.format(n=tasks))
    for path in (home, dags):
        path.chmod(0o755)  # read by the sandbox's unprivileged uid
    stack = start_executor_stack(
        home,
        dags,
        [str(dags), str(ROOT)],
        f"LocalExecutor,{ALIAS_CONFIG}",  # the alias: executor="PandaStackExecutor" gets its UUID
        {
            "AIRFLOW__CORE__PARALLELISM": str(tasks),
            "AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG": str(tasks),
            "AIRFLOW__PANDASTACK_EXECUTOR__WARM_POOL_SIZE": str(size),
            # This checkout's provider in the sandbox, whatever an editable install points at.
            "AIRFLOW__PANDASTACK_EXECUTOR__ENV": json.dumps({"PYTHONPATH": str(ROOT)}),
        },
    )
    gone = Gone(stack)
    legs = [(kind, shape) for shape in SHAPES for kind in KINDS]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {leg: [] for leg in legs}
    rss: dict[str, list[float]] = {}
    try:
        log(f"executor bench: stack up; 1 and {tasks} tasks per run, {rounds} rounds, {size} standbys")
        for kind, shape in legs:  # warm-up: imports, page cache, the template's pool
            one_run(stack, gone, kind, shape, size)
            log(f"executor bench: warm-up {kind}/{shape} done")
        wait_standbys_ready(stack, size)
        rss = standby_rss_mib(stack)
        for r in range(rounds):
            for shape in SHAPES:
                for kind in KINDS[r % 3 :] + KINDS[: r % 3]:
                    runs[(kind, shape)].append(one_run(stack, gone, kind, shape, size))
            log(f"executor bench: round {r + 1}/{rounds}; load {os.getloadavg()}")
        assert gone.tries() == 0, "PandaStackExecutor left a try's sandbox"
    finally:
        load_end = [round(x, 2) for x in os.getloadavg()]
        gone.stop.set()
        stack.stop()
        left = gone.standbys()  # the scheduler's end() closed the pool
        stack.server.close()
        shutil.rmtree(home, ignore_errors=True)
    out: dict[str, Any] = {
        "warm_pool_size": size,
        "standby_rss_mib": rss,
        "load_avg_end": load_end,
        "standbys_left": len(left),
    }
    for kind, shape in legs:
        tis = [t for run in runs[(kind, shape)] for t in run["tis"]]
        leg: dict[str, Any] = {
            "queued_to_end": summary(spans(tis, "queued", "end")),
            "run_wall": summary([run["wall_s"] for run in runs[(kind, shape)]]),
            "queued_to_start_p50_ms": p50_ms(spans(tis, "queued", "start")),
            "start_to_end_p50_ms": p50_ms(spans(tis, "start", "end")),
        }
        if kind != "local":
            leg["warm_tries"] = sum(1 for t in tis if t.get("warm"))
            leg["tries"] = len(tis)
            leg["breakdown_p50_ms"] = {
                "sandbox create or take (queued -> launched)": p50_ms(spans(tis, "queued", "launched")),
                "Airflow start-up inside (launched -> start)": p50_ms(spans(tis, "launched", "start")),
                "task + Execution API (start -> end)": p50_ms(spans(tis, "start", "end")),
                "copy-back + delete (end -> gone)": p50_ms(spans(tis, "end", "gone")),
            }
        out[f"{kind}_{shape}"] = leg
    for shape in SHAPES:
        local = out[f"local_{shape}"]["queued_to_end"]["p50_ms"]
        for kind in ("cold", "warm"):
            out[f"ratio_{kind}_{shape}"] = ratio(out[f"{kind}_{shape}"]["queued_to_end"]["p50_ms"], local)
    out["targets"] = {
        "one at a time: warm/local <= 2": out["ratio_warm_one"] <= 2,
        "six at once: warm/local <= 3": out["ratio_warm_six"] <= 3,
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warm-pool-size", type=int, default=0, help="standbys (default: --tasks)")
    args = parser.parse_args()
    started = machine()
    data = {
        "machine": started,
        "tasks": args.tasks,
        "rounds": args.rounds,
        **measure(args.tasks, args.rounds, args.warm_pool_size or args.tasks),
    }
    path = write_json("executor", data)
    log(
        f"executor bench: queued->end p50 / LocalExecutor: one at a time cold {data['ratio_cold_one']} "
        f"warm {data['ratio_warm_one']}; six at once cold {data['ratio_cold_six']} warm "
        f"{data['ratio_warm_six']}; load {started['load_avg']} -> {data['load_avg_end']}; {path}"
    )


if __name__ == "__main__":
    main()
