"""Before and after: the local server of a baseline commit beside this commit's, in one run.

Run: ``python -m benchmarks.baseline [--base REV] [--rounds 20] [--batch 10]``. Writes
``benchmarks/results/baseline.json``.

Why: the hardening (uid mapping, seccomp, device and /proc walls, bounded reads) and the real
templates must not cost the warm pool its speed, and a figure from last month's run on a
shared two-core machine is no yardstick. So both servers run now, side by side: the baseline
tree is exported with ``git archive`` (nothing is checked out over this one) and served by the
same interpreter with ``PYTHONPATH`` pointing at it. The same create -> exec ``true`` -> delete
loop runs against each in alternating batches (the order flips every round), so load from
other processes lands on both alike; the report compares medians as ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandastack

from benchmarks.common import log, machine, ratio, write_json
from benchmarks.local_server import OPS, lifecycle_timings
from benchmarks.local_server import summary as ms_summary
from pandastack_local import LocalServer
from pandastack_local.config import generate_api_key
from pandastack_local.harness import free_port

ROOT = Path(__file__).resolve().parent.parent
# The commit the comparison starts from: before the hardening (issue 12) and the templates (issue 13).
DEFAULT_BASE = "5319cd7"


@contextlib.contextmanager
def baseline_server(rev: str, pool_size: int | None) -> Iterator[Any]:
    """Serve the baseline tree's ``pandastack_local`` on a free port; yield an SDK client."""
    with tempfile.TemporaryDirectory(prefix="pandastack-baseline-") as tmp:
        tree, state = Path(tmp) / "tree", Path(tmp) / "state"
        tree.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev, "pandastack_local"], check=True, capture_output=True
        )
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
        port, key = free_port(), generate_api_key()
        argv = [sys.executable, "-m", "pandastack_local", "serve", "--port", str(port)]
        argv += ["--api-key", key, "--state-dir", str(state)]
        if pool_size is not None:
            argv += ["--pool-size", str(pool_size)]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        log_file = (Path(tmp) / "server.log").open("wb")
        proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            client = pandastack.Client(api_key=key, api_url=f"http://127.0.0.1:{port}")
            deadline = time.monotonic() + 30
            while True:
                try:
                    client.sandboxes.list()
                    break
                except Exception:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        server_log = (Path(tmp) / "server.log").read_text()
                        raise SystemExit(f"baseline server ({rev}) did not start:\n{server_log}") from None
                    time.sleep(0.2)
            yield client
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log_file.close()


def measure(rev: str, rounds: int, batch: int, pool_size: int | None) -> dict[str, Any]:
    """Alternating batches against the baseline server and this commit's; summaries and ratios."""
    runs: dict[str, dict[str, list[float]]] = {side: {op: [] for op in OPS} for side in ("base", "head")}
    with baseline_server(rev, pool_size) as base, LocalServer(pool_size=pool_size) as server:
        head = server.client()
        clients = {"base": base, "head": head}
        for client in clients.values():  # warm-up: imports, first pool fill
            lifecycle_timings(client, 5)
        for i in range(rounds):
            order = ("base", "head") if i % 2 == 0 else ("head", "base")
            for side in order:
                lifecycle_timings(clients[side], batch, 0.02, into=runs[side])  # pause: the pool refills
    result: dict[str, Any] = {side: {op: ms_summary(v) for op, v in t.items()} for side, t in runs.items()}
    result["n_per_side"] = len(runs["head"]["create"])
    result["ratio_p50"] = {
        op: ratio(result["head"][op]["p50_ms"], result["base"][op]["p50_ms"]) for op in OPS
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", default=DEFAULT_BASE, help="baseline git revision")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--cold-rounds", type=int, default=6)
    args = parser.parse_args()
    head_rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    results: dict[str, Any] = {"machine": machine(), "base": args.base, "head": head_rev or "working tree"}
    log(f"warm pool: {args.rounds} rounds x {args.batch} per side, base {args.base}")
    results["warm_pool"] = measure(args.base, args.rounds, args.batch, None)
    log(f"cold (no pool): {args.cold_rounds} rounds x 5 per side")
    results["cold"] = measure(args.base, args.cold_rounds, 5, 0)
    write_json("baseline", results)
    for mode in ("warm_pool", "cold"):
        r = results[mode]
        for op in OPS:
            log(
                f"{mode:<9} {op:<9} base p50 {r['base'][op]['p50_ms']:>7} ms  "
                f"head p50 {r['head'][op]['p50_ms']:>7} ms  head/base {r['ratio_p50'][op]}"
            )


if __name__ == "__main__":
    main()
