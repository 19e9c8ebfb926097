"""Shared pieces of the benchmarks: the job they all run, statistics and machine facts.

RSS comes from the one /proc walker of the tests, e2e and benchmarks, ``pandastack_local.testing.procs``.

Every measurement runs the *same* small job (input.json in,
result.json out) so that the numbers of different modules can be set side by side.
Absolute times drift on a shared machine; the modules therefore report ratios
measured in interleaved batches, and these helpers keep that bookkeeping in one place.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).parent / "results"
WORKDIR = "/work"
TEMPLATE = "code-interpreter"
JOB_TIMEOUT = 60

JOB_CODE = """\
import json, os
data = json.load(open(os.environ.get("JOB_INPUT", "/work/input.json")))
json.dump({"total": sum(data["rows"]), "n": len(data["rows"])},
          open(os.environ.get("JOB_RESULT", "/work/result.json"), "w"))
"""
"""The job: sum the input rows, write the result. ~30 ms of guest python start-up."""

JOB_INPUT: dict[str, Any] = {"rows": list(range(100))}
EXPECTED = {"total": sum(range(100)), "n": 100}
# The job as job options (JobSpec's, the operator's, the task's).
JOB_OPTIONS: dict[str, Any] = {
    "command": "python3 run.py",
    "files": {"run.py": JOB_CODE},
    "input": JOB_INPUT,
    "timeout": JOB_TIMEOUT,
}


# The ~30 ms Python job of the worker benchmarks (issue 37: benchmarks/kafka.py, benchmarks/celery.py):
# one function, run in-process by a plain Celery task and as a function job (its source in a fresh
# sandbox) by a sandbox task and by the Kafka consumer's messages, so every variant runs the same body.
SPIN_ROWS = list(range(100))
WORKER_TEMPLATE = "base"  # a plain python3, as a Celery pool process has
SPIN_ITERATIONS = 400_000  # about 30 ms of CPython on this project's 2-core machines


def spin_job(rows: list[int], iterations: int) -> dict[str, int]:
    """Sum the rows after ~30 ms of arithmetic."""
    spin = 0
    for i in range(iterations):
        spin += i & 7
    return {"total": sum(rows), "n": len(rows), "spin": spin}


def proc_cpu_s(pid: int, children: bool = True) -> float:
    """CPU seconds of a process (utime, stime) and of the children it has waited for (cutime,
    cstime; ``children=False`` leaves them out)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11 : 15 if children else 13]) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process tree so far: the process with its reaped children, plus every live
    descendant with its own (a sandbox that exits is counted by whoever waits for it)."""
    from pandastack_local.testing.procs import descendants

    return proc_cpu_s(pid) + sum(proc_cpu_s(p) for p in descendants(pid))


class ServerCpu:
    """CPU seconds of a server and of every sandbox it starts, exited ones included.

    A sandbox's processes do not all end up waited for by the server (its first process is
    killed and the rest die in their pid namespace), so ``/proc``'s cutime misses them. On a
    cgroup v1 host with ``cpuacct`` the server is moved into a ``cpuacct`` cgroup of its own: its
    sandboxes inherit it (the server puts them only in its memory, pids, cpu and freezer
    cgroups), and ``cpuacct.usage`` counts every process that ever ran there. Elsewhere (cgroup
    v2, no root) it falls back to :func:`tree_cpu_s`, a lower bound; ``method`` says which.
    """

    ROOT = Path("/sys/fs/cgroup/cpuacct")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.group: Path | None = None
        if (self.ROOT / "cpuacct.usage").exists():
            group = self.ROOT / f"pandastack-bench-{pid}"
            try:
                group.mkdir()
                (group / "cgroup.procs").write_text(str(pid))
                self.group = group
            except OSError:
                with contextlib.suppress(OSError):
                    group.rmdir()
        self.method = (
            "a cpuacct cgroup holding the server and its sandboxes"
            if self.group
            else "/proc: live processes and the children they waited for, a lower bound"
        )

    def seconds(self) -> float:
        if self.group is not None:
            return int((self.group / "cpuacct.usage").read_text()) / 1e9
        return tree_cpu_s(self.pid)

    def close(self, timeout: float = 30.0) -> None:
        """Remove the cgroup once the server has stopped (its last sandbox processes may still be
        on their way out: a cgroup is removed only when empty)."""
        if self.group is None:
            return
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.group.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    procs = (self.group / "cgroup.procs").read_text().split()
                    log(f"cgroup {self.group} not removed: it still holds {procs}")
                    return
                time.sleep(0.2)


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p99 of 60 samples is the largest but one)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def summary(values_s: list[float]) -> dict[str, float]:
    """Median, p99 and mean of per-job seconds, in ms."""
    ms = [v * 1000 for v in values_s]
    return {
        "n": len(ms),
        "p50_ms": round(statistics.median(ms), 2),
        "p99_ms": round(pct(ms, 99), 2),
        "mean_ms": round(statistics.fmean(ms), 2),
    }


def rate_and_latency(rounds: list[dict[str, Any]], n: int, prefix: str, unit: str) -> dict[str, float]:
    """One variant's row cells from its rounds (each ``wall_s`` and ``latencies_ms`` for ``n``
    items): the median throughput ``<prefix>_<unit>_s`` and p50/p99 over every item."""
    wall = statistics.median(x["wall_s"] for x in rounds)
    lat = [ms for x in rounds for ms in x["latencies_ms"]]
    return {
        f"{prefix}_{unit}_s": round(n / wall, 2),
        f"{prefix}_p50_ms": round(pct(lat, 50), 1),
        f"{prefix}_p99_ms": round(pct(lat, 99), 1),
    }


def bench_consumer(transport: Any, conn: Any, sink: Any, template: str, **kw: Any) -> Any:
    """A queue Consumer as every queue benchmark runs it: short polls and release delay (the
    benchmark's own wait is what it measures), the job's template and timeout as defaults."""
    from pandastack_jobs.queue import Consumer

    return Consumer(
        transport,
        conn,
        sink=sink,
        defaults={"template": template, "timeout": JOB_TIMEOUT},
        poll_seconds=0.05,
        release_delay=0.1,
        **kw,
    )


def ratio(num: float, den: float) -> float:
    return round(num / den, 3) if den else float("nan")


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call takes (the result is checked by the caller's ``fn``)."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def interleaved(
    variants: dict[str, Callable[[], Any]], rounds: int, batch: int, warmup: int = 2
) -> dict[str, list[float]]:
    """Run ``rounds`` batches of each variant, rotating the order every round.

    Machine drift (other people's test suites on the same two cores) then hits
    every variant equally; a fixed order would bias whichever ran in the quiet.
    """
    names = list(variants)
    for name in names:
        for _ in range(warmup):
            variants[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            samples[name].extend(timed(variants[name]) for _ in range(batch))
    return samples


def version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """Cores, memory, kernel, load and the versions that every figure states."""
    mem_kb = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_kb = int(line.split()[1])
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": round(mem_kb / 1024 / 1024, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "pandastack": version("pandastack"),
        "apache-airflow": version("apache-airflow"),
        "prefect": version("prefect"),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_json(name: str, data: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
