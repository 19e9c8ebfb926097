"""Latency of pandastack-local through the real SDK over HTTP (a benchmark, not a test).

Run: ``python -m benchmarks.local_server [--n 200] [--concurrent 50]``. Writes
``benchmarks/results/local_server.json`` and prints a table. Measures, per sandbox,
create / exec ``true`` / delete and the full create->exec->delete, both with the
server's warm pool (the default: a few pre-started, fully limited, never-reused
sandboxes per template) and with the pool disabled (every create cold-starts
bwrap and the agent), then N sandboxes alive at once.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.options import int_options
from pandastack_local import LocalServer

RESULTS = Path(__file__).parent / "results" / "local_server.json"
OPS = ("create", "exec_true", "delete", "full")


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(pct(values, 50), 2),
        "p99_ms": round(pct(values, 99), 2),
        "mean_ms": round(statistics.fmean(values), 2),
    }


def lifecycle_timings(
    client: Any, n: int, pause: float = 0.0, into: dict[str, list[float]] | None = None
) -> dict[str, list[float]]:
    """n x (create -> exec ``true`` -> delete) on ``base``: ms per op (appended to ``into``)."""
    timings = into if into is not None else {op: [] for op in OPS}
    for _ in range(n):
        t0 = time.perf_counter()
        sb = client.sandboxes.create(template="base")
        t1 = time.perf_counter()
        result = sb.exec("true")
        t2 = time.perf_counter()
        client.sandboxes.delete(sb.id)
        t3 = time.perf_counter()
        if result.exit_code != 0:
            raise SystemExit(f"exec true exited {result.exit_code}: {result.stderr!r}")
        for op, value in zip(OPS, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
            timings[op].append(value * 1000)
        if pause:
            time.sleep(pause)
    return timings


def sequential(client: Any, n: int, pause: float) -> dict[str, Any]:
    return {k: summary(v) for k, v in lifecycle_timings(client, n, pause).items()}


def concurrent(client: Any, n: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=8) as pool:
        sandboxes = list(pool.map(lambda _: client.sandboxes.create(template="base"), range(n)))
    t1 = time.perf_counter()
    alive = len(client.sandboxes.list())
    with ThreadPoolExecutor(max_workers=8) as pool:
        outs = list(pool.map(lambda sb: sb.exec("echo $$ > /work/pid; cat /work/pid").exit_code, sandboxes))
    t2 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda sb: client.sandboxes.delete(sb.id), sandboxes))
    t3 = time.perf_counter()
    return {
        "sandboxes": n,
        "alive_at_once": alive,
        "all_exec_ok": all(code == 0 for code in outs),
        "create_all_s": round(t1 - t0, 3),
        "exec_all_s": round(t2 - t1, 3),
        "delete_all_s": round(t3 - t2, 3),
    }


def main() -> None:
    args = int_options(n=200, cold_n=50, concurrent=50)
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "load_avg_at_start": os.getloadavg(),
        },
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    # Idle sandboxes, overcommitted on purpose: the default memory budget would refuse the 11th 2 GB one.
    with LocalServer(max_sandboxes=args.concurrent + 10, memory_budget_mb=0) as server:
        client = server.client()
        sequential(client, 10, 0)  # warm-up
        results["warm_pool"] = {"n": args.n, **sequential(client, args.n, 0)}
        results["concurrent"] = concurrent(client, args.concurrent)
    with LocalServer(pool_size=0) as server:
        client = server.client()
        results["cold"] = {"n": args.cold_n, **sequential(client, args.cold_n, 0)}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"pandastack-local latency ({results['machine']['cpus']} CPUs), ms; full = create+exec+delete")
    print(f"{'mode':<10} {'n':>4} {'op':<10} {'p50':>8} {'p99':>8} {'mean':>8}")
    for mode in ("warm_pool", "cold"):
        for op in ("create", "exec_true", "delete", "full"):
            s = results[mode][op]
            n = results[mode]["n"]
            print(f"{mode:<10} {n:>4} {op:<10} {s['p50_ms']:>8} {s['p99_ms']:>8} {s['mean_ms']:>8}")
    c = results["concurrent"]
    print(
        f"concurrent: {c['alive_at_once']}/{c['sandboxes']} alive at once, exec ok={c['all_exec_ok']}, "
        f"create all {c['create_all_s']}s, exec all {c['exec_all_s']}s, delete all {c['delete_all_s']}s"
    )
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
