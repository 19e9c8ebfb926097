"""(6) Orchestrator memory (RSS) over 1,000 jobs through the core.

Run: ``python -m benchmarks.memory [--jobs 1000 --concurrency 4]``. A Prefect
worker or a long-lived Python orchestrator runs many jobs in one process, so a
leak per job would show here as a slope. RSS is sampled every ``--every`` jobs;
the growth is measured from the first sample after warm-up (imports, pools and
the allocator's arenas settle during the first jobs), then after a ``gc.collect``.
Concurrency 4 (threads) keeps the run short on two cores; each job has its own client.
"""

from __future__ import annotations

import gc
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.common import EXPECTED, JOB_CODE, JOB_INPUT, JOB_TIMEOUT, log, machine, write_json
from benchmarks.options import int_options
from pandastack_local.testing.procs import rss_kb


def main() -> None:
    args = int_options(jobs=1000, concurrency=4, every=50)
    from pandastack_jobs import ConnectionConfig, JobSpec, run_job
    from pandastack_local import LocalServer

    spec = JobSpec(command="python3 run.py", files={"run.py": JOB_CODE}, input=JOB_INPUT, timeout=JOB_TIMEOUT)
    samples: list[tuple[int, float]] = [(0, rss_kb() / 1024)]
    done = 0
    lock = threading.Lock()

    with LocalServer() as server:
        config = ConnectionConfig(api_url=server.url, api_key=server.api_key)

        def one(_: int) -> None:
            nonlocal done
            outcome = run_job(config.client(), spec)
            assert outcome.ok and outcome.result == EXPECTED, outcome.reason
            with lock:
                done += 1
                if done % args.every == 0:
                    samples.append((done, rss_kb() / 1024))

        log(f"memory: {args.jobs} jobs at concurrency {args.concurrency}")
        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            list(pool.map(one, range(args.jobs)))
        leaked = config.client().sandboxes.list()
    gc.collect()
    final_after_gc = rss_kb() / 1024
    warm_jobs, warm_mb = next(((n, mb) for n, mb in samples if n >= 100), samples[-1])
    end_jobs, end_mb = samples[-1]
    slope_kb = (end_mb - warm_mb) * 1024 / max(1, end_jobs - warm_jobs)
    data: dict[str, Any] = {
        "machine": machine(),
        "jobs": args.jobs,
        "concurrency": args.concurrency,
        "rss_mb_at_start": round(samples[0][1], 1),
        "rss_mb_after_warmup": round(warm_mb, 1),
        "warmup_jobs": warm_jobs,
        "rss_mb_at_end": round(end_mb, 1),
        "rss_mb_after_gc": round(final_after_gc, 1),
        "growth_kb_per_job_after_warmup": round(slope_kb, 2),
        "sandboxes_left": len(leaked),
        "samples": [{"jobs": n, "rss_mb": round(mb, 1)} for n, mb in samples],
    }
    log(f"memory written to {write_json('memory', data)}")


if __name__ == "__main__":
    main()
