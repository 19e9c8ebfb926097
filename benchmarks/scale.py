"""(4) Scale: 200 jobs at concurrency 1, 2, 4, 8 through the core, in threads.

Run: ``python -m benchmarks.scale [--jobs 200]``. This process imports only the
core (no engine), so its RSS is the orchestrator's own cost. A sampler thread
asks the server for its live sandboxes every 100 ms and records the RSS of the
server process, of the server with all its sandboxes, and of this process.
Each job builds its own client, as the adapters do (clients are per thread).
"""

from __future__ import annotations

import argparse
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
    rss_kb,
    summary,
    tree_rss_kb,
    write_json,
)

LEVELS = (1, 2, 4, 8)


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


def run_level(url: str, api_key: str, server_pid: int, jobs: int, concurrency: int) -> dict[str, Any]:
    from pandastack_jobs import ConnectionConfig, JobSpec, run_job

    config = ConnectionConfig(api_url=url, api_key=api_key)
    spec = JobSpec(command="python3 run.py", files={"run.py": JOB_CODE}, input=JOB_INPUT, timeout=JOB_TIMEOUT)

    def one(_: int) -> float:
        started = time.perf_counter()
        outcome = run_job(config.client(), spec)
        assert outcome.ok and outcome.result == EXPECTED, outcome.reason
        return time.perf_counter() - started

    sampler = Sampler(config.client(), server_pid)
    sampler.start()
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        latencies = list(pool.map(one, range(jobs)))
    wall = time.perf_counter() - started
    peak = sampler.stop()
    return {
        "concurrency": concurrency,
        "jobs": jobs,
        "wall_s": round(wall, 2),
        "throughput_jobs_per_s": round(jobs / wall, 2),
        "latency": summary(latencies),
        "peak_live_sandboxes": peak["live_sandboxes"],
        "peak_server_rss_mb": round(peak["server_rss_kb"] / 1024, 1),
        "peak_server_tree_rss_mb": round(peak["server_tree_rss_kb"] / 1024, 1),
        "peak_orchestrator_rss_mb": round(peak["orchestrator_rss_kb"] / 1024, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=200)
    args = parser.parse_args()
    from pandastack_local import LocalServer

    levels = []
    with LocalServer() as server:
        assert server.pid is not None
        run_level(server.url, server.api_key, server.pid, 10, 2)  # warm-up: imports, page cache
        for concurrency in LEVELS:
            log(f"scale: {args.jobs} jobs at concurrency {concurrency}")
            levels.append(run_level(server.url, server.api_key, server.pid, args.jobs, concurrency))
    base = levels[0]["throughput_jobs_per_s"]
    for level in levels:
        level["speedup_vs_c1"] = round(level["throughput_jobs_per_s"] / base, 2)
    data = {"machine": machine(), "levels": levels}
    log(f"scale written to {write_json('scale', data)}")


if __name__ == "__main__":
    main()
