"""(4) Scale: 200 jobs at concurrency 1, 2, 4, 8 through the core, in threads.

Run: ``python -m benchmarks.scale [--jobs 200 --rounds 4]``. Each level's jobs run
in ``rounds`` chunks and the level order rotates every round, so drift from other
processes on the machine is spread over all levels. This process imports only the
core (no engine), so its RSS is the orchestrator's own cost. A sampler thread
asks the server for its live sandboxes every 100 ms and records the RSS of the
server process, of the server with all its sandboxes, and of this process.
Each job builds its own client, as the adapters do (clients are per thread).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.common import (
    EXPECTED,
    JOB_CODE,
    JOB_INPUT,
    JOB_TIMEOUT,
    log,
    machine,
    summary,
    write_json,
)
from benchmarks.options import int_options
from pandastack_local.testing.procs import rss_kb, tree_rss_kb

LEVELS = [1, 2, 4, 8]


class Sampler(threading.Thread):
    """Peak live sandboxes (as the server lists them) and peak RSS while a level runs."""

    def __init__(self, client: Any, server_pid: int, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.client, self.server_pid, self.interval = client, server_pid, interval
        self.stop_event = threading.Event()
        self.peak = {
            "live_sandboxes": 0,
            "server_rss_kb": 0,
            "server_tree_rss_kb": 0,
            "orchestrator_rss_kb": 0,
        }

    def run(self) -> None:
        while not self.stop_event.is_set():
            now = {
                "live_sandboxes": len(self.client.sandboxes.list()),
                "server_rss_kb": rss_kb(self.server_pid),
                "server_tree_rss_kb": tree_rss_kb(self.server_pid),
                "orchestrator_rss_kb": rss_kb(),
            }
            for key, value in now.items():
                self.peak[key] = max(self.peak[key], value)
            self.stop_event.wait(self.interval)

    def stop(self) -> dict[str, int]:
        self.stop_event.set()
        self.join()
        return self.peak


def run_chunk(config: Any, spec: Any, jobs: int, concurrency: int) -> tuple[float, list[float]]:
    """Run ``jobs`` jobs on ``concurrency`` threads; return (wall seconds, per-job seconds)."""
    from pandastack_jobs import run_job

    def one(_: int) -> float:
        started = time.perf_counter()
        outcome = run_job(config.client(), spec)
        assert outcome.ok and outcome.result == EXPECTED, outcome.reason
        return time.perf_counter() - started

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        latencies = list(pool.map(one, range(jobs)))
    return time.perf_counter() - started, latencies


def run_levels(url: str, api_key: str, server_pid: int, jobs: int, rounds: int) -> list[dict[str, Any]]:
    """Each level runs ``jobs`` jobs in ``rounds`` chunks; the level order rotates every round,
    so a burst of load from other processes is spread over all levels, not pinned on one."""
    from pandastack_jobs import ConnectionConfig, JobSpec

    config = ConnectionConfig(api_url=url, api_key=api_key)
    spec = JobSpec(command="python3 run.py", files={"run.py": JOB_CODE}, input=JOB_INPUT, timeout=JOB_TIMEOUT)
    run_chunk(config, spec, 10, 2)  # warm-up: imports, page cache, the server's pool
    wall = dict.fromkeys(LEVELS, 0.0)
    latencies: dict[int, list[float]] = {c: [] for c in LEVELS}
    peaks: dict[int, dict[str, int]] = {}
    for r in range(rounds):
        order = LEVELS[r % len(LEVELS) :] + LEVELS[: r % len(LEVELS)]
        for concurrency in order:
            sampler = Sampler(config.client(), server_pid)
            sampler.start()
            chunk_wall, chunk_latencies = run_chunk(config, spec, jobs // rounds, concurrency)
            peak = sampler.stop()
            wall[concurrency] += chunk_wall
            latencies[concurrency] += chunk_latencies
            prev = peaks.setdefault(concurrency, dict.fromkeys(peak, 0))
            for key, value in peak.items():
                prev[key] = max(prev[key], value)
    return [
        {
            "concurrency": c,
            "jobs": len(latencies[c]),
            "wall_s": round(wall[c], 2),
            "throughput_jobs_per_s": round(len(latencies[c]) / wall[c], 2),
            "latency": summary(latencies[c]),
            "peak_live_sandboxes": peaks[c]["live_sandboxes"],
            "peak_server_rss_mb": round(peaks[c]["server_rss_kb"] / 1024, 1),
            "peak_server_tree_rss_mb": round(peaks[c]["server_tree_rss_kb"] / 1024, 1),
            "peak_orchestrator_rss_mb": round(peaks[c]["orchestrator_rss_kb"] / 1024, 1),
        }
        for c in LEVELS
    ]


def main() -> None:
    args = int_options(jobs=200, rounds=4)
    from pandastack_local import LocalServer

    with LocalServer() as server:
        assert server.pid is not None
        log(f"scale: {args.jobs} jobs at each concurrency {LEVELS}, in {args.rounds} rotated rounds")
        levels = run_levels(server.url, server.api_key, server.pid, args.jobs, args.rounds)
    base = levels[0]["throughput_jobs_per_s"]
    for level in levels:
        level["speedup_vs_c1"] = round(level["throughput_jobs_per_s"] / base, 2)
    data = {"machine": machine(), "levels": levels}
    log(f"scale written to {write_json('scale', data)}")


if __name__ == "__main__":
    main()
