"""(issue 37) Celery: sandbox tasks against a plain Celery prefork worker, on one real Redis.

Run in ``.venv-celery``: ``python -m benchmarks.celery [--n N --rounds R]``. It starts its own
``redis-server`` (:mod:`benchmarks.redis_server`, broker and result backend) and
``pandastack_local``, and for each variant and concurrency 1/2/4/8 a ``celery worker``
(prefork, ``--concurrency c``) of :mod:`benchmarks.celery_app`; every run sends the same N calls
of the same ~30 ms Python job at once and waits for every result:

- ``plain cN``: ``bench.plain``, the job in the pool process (what Celery users run today);
- ``sandboxed cN``: ``bench.sandboxed``, the same body as a sandbox task (a fresh sandbox each).

Throughput is N over the wall time from the first send to the last result; the latency of a
call is from its send to its ``date_done`` in the result backend (the worker's clock: the same
host). Each worker is warmed with 2c calls first (pool processes, imports, the server's pool).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.common import (
    SPIN_ITERATIONS,
    SPIN_ROWS,
    ServerCpu,
    log,
    machine,
    rate_and_latency,
    ratio,
    tree_cpu_s,
    write_json,
)
from benchmarks.options import int_options
from benchmarks.redis_server import RedisServer

LEVELS = (1, 2, 4, 8)
VARIANTS = ("plain", "sandboxed")
REPO = Path(__file__).resolve().parents[1]


def start_worker(
    variant: str, c: int, env: dict[str, str], queue: str, log_path: Path
) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable, "-m", "celery", "-A", "benchmarks.celery_app", "worker",
        "--pool", "prefork", "--concurrency", str(c), "--queues", queue, "--loglevel", "WARNING",
        "--without-gossip", "--without-mingle", "--without-heartbeat", "--hostname", f"{queue}@%h",
    ]  # fmt: skip
    with open(log_path, "wb") as out:
        return subprocess.Popen(
            argv, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def one_run(app: Any, variant: str, n: int, queue: str, iterations: int) -> dict[str, Any]:
    sent: list[tuple[float, Any]] = []
    t0 = time.time()
    for _ in range(n):
        sent.append(
            (time.time(), app.send_task(f"bench.{variant}", args=(SPIN_ROWS, iterations), queue=queue))
        )
    for _, r in sent:
        assert r.get(timeout=300)["total"] == sum(SPIN_ROWS)
    done = []
    for at, r in sent:
        meta = r.backend.get_task_meta(r.id)
        when = meta["date_done"]
        if isinstance(when, str):
            when = datetime.fromisoformat(when)
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        done.append((when.timestamp(), at))
    end = max(d for d, _ in done)
    latencies = [max(0.0, d - at) * 1000 for d, at in done]
    return {"wall_s": end - t0, "latencies_ms": latencies}


def main() -> None:
    args = int_options(n=32, rounds=2, iterations=SPIN_ITERATIONS)
    from celery import Celery

    from pandastack_local import LocalServer

    start = machine()
    log(f"celery: load average at start {start['load_avg']}")
    runs: dict[str, list[dict[str, Any]]] = {}
    cpu: dict[str, dict[str, float]] = {}
    logs = Path(tempfile.mkdtemp(prefix="bench-celery-"))
    with RedisServer() as redis, LocalServer() as server:
        url = f"redis://127.0.0.1:{redis.port}"
        env = {
            **os.environ,
            **server.env(),
            "BENCH_CELERY_BROKER": f"{url}/0",
            "BENCH_CELERY_BACKEND": f"{url}/1",
            "PYTHONPATH": str(REPO),
        }
        server_pid = server.pid
        assert server_pid is not None
        server_cpu = ServerCpu(server_pid)
        app = Celery("bench", broker=f"{url}/0", backend=f"{url}/1", set_as_current=False)
        for c in LEVELS:
            for variant in VARIANTS:
                queue = f"b{variant[0]}{c}-{uuid.uuid4().hex[:6]}"
                worker = start_worker(variant, c, env, queue, logs / f"{queue}.log")
                try:
                    one_run(app, variant, 2 * c, queue, args.iterations)  # warm-up
                    server0, worker0 = server_cpu.seconds(), tree_cpu_s(worker.pid)
                    for _ in range(args.rounds):
                        time.sleep(0.5)  # the server's warm pool refills
                        runs.setdefault(f"{variant} c{c}", []).append(
                            one_run(app, variant, args.n, queue, args.iterations)
                        )
                    tasks = args.n * args.rounds
                    cpu[f"{variant} c{c}"] = {
                        "server_ms": round((server_cpu.seconds() - server0) / tasks * 1000, 1),
                        "worker_ms": round((tree_cpu_s(worker.pid) - worker0) / tasks * 1000, 1),
                    }
                finally:
                    os.killpg(worker.pid, 9)
                    worker.wait(10)
                log(f"celery: {variant} c{c} done, load average {[round(x, 2) for x in os.getloadavg()]}")
        app.close()
        assert server.client().sandboxes.list() == [], "a variant leaked a sandbox"
    server_cpu.close()
    end = machine()
    data = report(runs, cpu, args.n)
    data.update(
        machine=start, finished=end, n=args.n, rounds=args.rounds, iterations=args.iterations,
        server_cpu=server_cpu.method,
    )  # fmt: skip
    log(f"celery written to {write_json('celery', data)}")
    for lv in data["levels"]:
        log(
            f"  c={lv['concurrency']}: sandboxed {lv['sandboxed_tasks_s']} tasks/s "
            f"(p50 {lv['sandboxed_p50_ms']} ms, p99 {lv['sandboxed_p99_ms']} ms), plain "
            f"{lv['plain_tasks_s']} (p50 {lv['plain_p50_ms']} ms, p99 {lv['plain_p99_ms']} ms): "
            f"sandboxed/plain {lv['sandboxed_vs_plain']}"
        )


def report(runs: dict[str, list[dict[str, Any]]], cpu: dict[str, dict[str, float]], n: int) -> dict[str, Any]:
    """Median throughput per variant and level, latency percentiles over every call, the ratio,
    the CPU per task of the worker's tree and of the server's (the server and its sandboxes)."""
    levels = []
    for c in LEVELS:
        row: dict[str, Any] = {"concurrency": c}
        for variant in VARIANTS:
            name = f"{variant} c{c}"
            row |= rate_and_latency(runs[name], n, variant, "tasks")
            row[f"{variant}_worker_cpu_ms"] = cpu[name]["worker_ms"]
            row[f"{variant}_server_cpu_ms"] = cpu[name]["server_ms"]
        row["sandboxed_vs_plain"] = ratio(row["sandboxed_tasks_s"], row["plain_tasks_s"])
        levels.append(row)
    return {"levels": levels}


if __name__ == "__main__":
    main()
