"""(issue 17 item 7) Per-task overhead of ``PandaStackExecutor`` against ``LocalExecutor``.

``python -m benchmarks.executor [--tasks N] [--rounds R]`` (in ``.venv-airflow``). One
scheduler with ``executor = LocalExecutor,PandaStackExecutor:airflow_provider.executors.PandaStackExecutor``
on SQLite, one api-server, one pandastack-local (the workers' venv as template, egress to the
api-server only), and the same DAG of N independent trivial ``@task``s twice: ``bench_local``
on LocalExecutor and ``bench_pandastack`` on PandaStackExecutor. Runs alternate (after one
warm-up run of each), so machine drift hits both alike.

Every figure comes from timestamps one can observe: the TI's ``queued_dttm``, ``start_date``
(the task runner's first Execution API call, i.e. Airflow is up inside the process/sandbox) and
``end_date``; the workload's launch time inside the sandbox (``started_at`` of the handle the
executor persists in ``external_executor_id``); and when the sandbox disappears from the
server's list (a 0.2 s sampler). Per PandaStack try:
queued -> launched = pick-up + sandbox create + the id file; launched -> start = Airflow start-up
inside the sandbox (interpreter, imports, DAG parse); start -> end = the task with its Execution
API round trips through the egress relay; end -> gone = log copy-back and delete.
"""

from __future__ import annotations

import argparse
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
from pandastack_local.testing.executor_stack import ExecutorStack, start_executor_stack

ROOT = Path(__file__).resolve().parent.parent
DAG = """
from airflow.sdk import dag, task

for executor in ("LocalExecutor", "PandaStackExecutor"):
    name = "local" if executor == "LocalExecutor" else "pandastack"

    @dag(dag_id=f"bench_{{name}}", schedule=None, catchup=False, default_args={{"executor": executor}})
    def bench():
        for i in range({n}):

            @task(task_id=f"t{{i}}")
            def trivial():
                return 1

            trivial()

    bench()
"""
KINDS = ("local", "pandastack")


def _epoch(value: str | None) -> float | None:
    if not value:
        return None
    when = datetime.fromisoformat(value)
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


class Gone:
    """When each executor sandbox was last listed by the server (its try UUID -> epoch seconds)."""

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
                    uuid = (sb.metadata or {}).get("airflow_ti_uuid")
                    if uuid:
                        self.last_seen[uuid] = now
            except Exception as exc:
                log(f"executor bench: sampler: {exc}")
            self.stop.wait(0.2)

    def live(self) -> int:
        return len(self.client.sandboxes.list())


def one_run(stack: ExecutorStack, gone: Gone, kind: str) -> dict[str, Any]:
    dag_id = f"bench_{kind}"
    run_id = stack.trigger(dag_id)
    assert stack.wait_run(dag_id, run_id, timeout=600) == "success", stack.log_tail("scheduler")
    if kind == "pandastack":  # every sandbox deleted: the cleanup is part of the cost
        deadline = time.monotonic() + 120
        while gone.live() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)
    rows = stack.query(
        "select queued_dttm, start_date, end_date, external_executor_id from task_instance "
        "where dag_id=? and run_id=?",
        dag_id,
        run_id,
    )
    (run_start, run_end) = stack.query(
        "select start_date, end_date from dag_run where dag_id=? and run_id=?", dag_id, run_id
    )[0]
    tis = []
    for queued, start, end, external in rows:
        ti: dict[str, float | None] = {"queued": _epoch(queued), "start": _epoch(start), "end": _epoch(end)}
        ref = SandboxExecutionRef.decode(external, expected_driver="pandastack")
        if ref is not None:
            ti["launched"] = float(ref.handle.data["started_at"])
            seen = gone.last_seen.get(ref.request_id)  # the try's UUID on the sandbox's metadata
            ti["gone"] = seen + 0.1 if seen else None
        tis.append(ti)
    wall = (_epoch(run_end) or 0) - (_epoch(run_start) or 0)
    return {"tis": tis, "wall_s": wall}


def spans(tis: list[dict[str, Any]], a: str, b: str) -> list[float]:
    return [t[b] - t[a] for t in tis if t.get(a) is not None and t.get(b) is not None]


def p50_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 1) if values else float("nan")


def measure(tasks: int, rounds: int) -> dict[str, Any]:
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
        {"AIRFLOW__CORE__PARALLELISM": str(tasks), "AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG": str(tasks)},
    )
    gone = Gone(stack)
    try:
        log(f"executor bench: stack up; {tasks} tasks per run, {rounds} rounds")
        for kind in KINDS:  # warm-up: imports, page cache, the template's pool
            one_run(stack, gone, kind)
            log(f"executor bench: warm-up {kind} done")
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
        for r in range(rounds):
            for kind in KINDS[r % 2 :] + KINDS[: r % 2]:
                runs[kind].append(one_run(stack, gone, kind))
            log(f"executor bench: round {r + 1}/{rounds}")
        assert gone.live() == 0, "PandaStackExecutor left a sandbox"
    finally:
        gone.stop.set()
        stack.stop()
        stack.server.close()
        shutil.rmtree(home, ignore_errors=True)
    out: dict[str, Any] = {}
    for kind in KINDS:
        tis = [t for run in runs[kind] for t in run["tis"]]
        out[kind] = {
            "queued_to_end": summary(spans(tis, "queued", "end")),
            "run_wall": summary([run["wall_s"] for run in runs[kind]]),
            "queued_to_start_p50_ms": p50_ms(spans(tis, "queued", "start")),
            "start_to_end_p50_ms": p50_ms(spans(tis, "start", "end")),
        }
    ps = [t for run in runs["pandastack"] for t in run["tis"]]
    out["pandastack"]["breakdown_p50_ms"] = {
        "sandbox create (queued -> launched)": p50_ms(spans(ps, "queued", "launched")),
        "Airflow start-up inside (launched -> start)": p50_ms(spans(ps, "launched", "start")),
        "task + Execution API (start -> end)": p50_ms(spans(ps, "start", "end")),
        "copy-back + delete (end -> gone)": p50_ms(spans(ps, "end", "gone")),
    }
    local, sand = out["local"], out["pandastack"]
    out["ratio_p50_queued_to_end"] = ratio(sand["queued_to_end"]["p50_ms"], local["queued_to_end"]["p50_ms"])
    out["ratio_p50_run_wall"] = ratio(sand["run_wall"]["p50_ms"], local["run_wall"]["p50_ms"])
    out["extra_ms_per_task_p50"] = round(
        sand["queued_to_end"]["p50_ms"] - local["queued_to_end"]["p50_ms"], 1
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    started = machine()
    data = {
        "machine": started,
        "tasks": args.tasks,
        "rounds": args.rounds,
        **measure(args.tasks, args.rounds),
    }
    path = write_json("executor", data)
    log(
        f"executor bench: pandastack/local queued->end p50 {data['ratio_p50_queued_to_end']}, "
        f"run wall {data['ratio_p50_run_wall']}; {path}"
    )


if __name__ == "__main__":
    main()
