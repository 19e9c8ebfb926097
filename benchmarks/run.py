"""``make bench``: run every benchmark of issue 8 in one go and regenerate RESULTS.md and the plot.

Each measurement runs as its own subprocess (a fresh interpreter, its own
pandastack-local server): a module's imports and threads cannot colour the next
one's RSS or latency, and the Prefect part can run in ``.venv-prefect`` and the Celery part
in ``.venv-celery`` while everything else runs in ``.venv-airflow``. Output of each step goes to a log
file; the driver prints one line per step and the tail of the log if a step fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, log, machine, write_json

ROOT = Path(__file__).resolve().parent.parent
PREFECT_PYTHON = os.environ.get(
    "PANDASTACK_BENCH_PREFECT_PYTHON", str(ROOT / ".venv-prefect" / "bin" / "python")
)
# Celery's steps run in its own venv (the Makefile's .venv-celery: the core, the server, Celery).
CELERY_PYTHON = os.environ.get(
    "PANDASTACK_BENCH_CELERY_PYTHON", str(ROOT / ".venv-celery" / "bin" / "python")
)

AF = sys.executable
# (name, python, module, full-run arguments, quick-run arguments). Batches of 2, rotated
# every round: drift on a shared machine then hits every variant alike.
STEPS: list[tuple[str, str, str, list[str], list[str]]] = [
    ("local_server", AF, "benchmarks.local_server", [], ["--n", "40", "--cold-n", "10"]),
    ("baseline", AF, "benchmarks.baseline", [], ["--rounds", "4", "--batch", "5", "--cold-rounds", "2"]),
    ("templates", AF, "benchmarks.templates", [], ["--n", "10", "--imports", "5"]),
    ("overhead", AF, "benchmarks.overhead", ["--rounds", "30", "--batch", "2"], ["--rounds", "4"]),
    ("observability", AF, "benchmarks.observability", ["--rounds", "15", "--batch", "2"], ["--rounds", "3"]),
    ("prefect_overhead", PREFECT_PYTHON, "benchmarks.prefect_overhead", ["--rounds", "30", "--batch", "2"],
     ["--rounds", "4", "--batch", "2"]),
    ("prefect_worker", PREFECT_PYTHON, "benchmarks.prefect_worker", ["--rounds", "8"], ["--rounds", "2"]),
    ("executor", AF, "benchmarks.executor", ["--tasks", "6", "--rounds", "2"],
     ["--tasks", "3", "--rounds", "1"]),
    ("breakdown", AF, "benchmarks.breakdown", ["--rounds", "10", "--batch", "2"], ["--rounds", "2"]),
    ("isolation", AF, "benchmarks.isolation", ["--rounds", "20", "--batch", "2"], ["--rounds", "2"]),
    ("warm", AF, "benchmarks.warm", ["--rounds", "6"], ["--rounds", "2"]),
    ("scale", AF, "benchmarks.scale", ["--jobs", "200"], ["--jobs", "40"]),
    ("memory", AF, "benchmarks.memory", ["--jobs", "1000"], ["--jobs", "200"]),
    ("gvisor", AF, "benchmarks.gvisor", ["--n", "20"], ["--n", "5"]),
    ("density", AF, "benchmarks.density", ["--target", "500"], ["--target", "40"]),
    ("queue", AF, "benchmarks.queue", ["--n", "32", "--rounds", "4"], ["--n", "8", "--rounds", "1"]),
    ("kafka", AF, "benchmarks.kafka", ["--n", "32", "--rounds", "3"], ["--n", "8", "--rounds", "1"]),
    ("celery", CELERY_PYTHON, "benchmarks.celery", ["--n", "32", "--rounds", "3"],
     ["--n", "8", "--rounds", "1"]),
]  # fmt: skip


def run_step(name: str, python: str, module: str, args: list[str], logs: Path) -> float:
    """Run one benchmark module; return its wall time. Raises with the log's tail on failure."""
    if python == PREFECT_PYTHON:
        args = [*args, "--out", str(RESULTS_DIR / f"{name}.json")]
    log_path = logs / f"{name}.log"
    started = time.perf_counter()
    with log_path.open("wb") as out:
        proc = subprocess.run(
            [python, "-m", module, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, check=False
        )
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"benchmark {name} failed (exit {proc.returncode}); log {log_path}:\n{tail}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small N, for trying the pipeline")
    parser.add_argument("--only", nargs="*", help="run only these steps (the report uses all results)")
    parser.add_argument("--report-only", action="store_true", help="regenerate RESULTS.md and the plot")
    options = parser.parse_args()
    for python, env in ((PREFECT_PYTHON, "PREFECT"), (CELERY_PYTHON, "CELERY")):
        if not options.report_only and not Path(python).exists():
            raise SystemExit(f"{python} is missing: run `make venvs` (or set PANDASTACK_BENCH_{env}_PYTHON)")
    started = time.perf_counter()
    run_info: dict[str, Any] = {"started": machine(), "quick": options.quick, "steps": {}}
    logs = Path(tempfile.mkdtemp(prefix="pandastack-bench-"))
    if not options.report_only:
        log(f"logs in {logs}")
        for name, python, module, full, quick in STEPS:
            if options.only and name not in options.only:
                continue
            log(f"{name} ...")
            wall = run_step(name, python, module, quick if options.quick else full, logs)
            run_info["steps"][name] = {"wall_s": round(wall, 1), "args": quick if options.quick else full}
            log(f"{name} done in {wall:.0f}s")
        if options.only and (RESULTS_DIR / "run.json").exists():
            previous = json.loads((RESULTS_DIR / "run.json").read_text())
            run_info["steps"] = {**previous.get("steps", {}), **run_info["steps"]}
        run_info["wall_s"] = round(time.perf_counter() - started, 1)
        run_info["finished"] = machine()
        write_json("run", run_info)
    from benchmarks.plot import plot
    from benchmarks.report import write_report

    png = plot()
    md = write_report()
    log(f"wrote {md} and {png} in {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
