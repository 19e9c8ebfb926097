"""Soak through the core: 1,000 jobs, four worker threads. After a warm-up, the orchestrator's
RSS grows less than 5% and its open descriptors stay flat; zero sandboxes remain."""

from __future__ import annotations

import gc
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pandastack_jobs import ConnectionConfig, JobKey, JobSpec, run_job
from pandastack_local.testing.procs import rss_and_fds
from tests.reliability.catalogue import TEMPLATE

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.timeout(1200)]

TOTAL = 1000
WARMUP = 100
WORKERS = 4
# The whole lifecycle (create, deliver a file and the input, exec, collect, delete) with a job that
# costs no interpreter start: the soak measures the orchestrator, not the guest.
JOB = 'n=$(cat "$JOB_INPUT"); echo "job $n"; echo "{\\"n\\": $n, \\"square\\": $((n * n))}" > "$JOB_RESULT"\n'


def soak_spec(run: str, n: int) -> JobSpec:
    return JobSpec(
        command="sh job.sh",
        files={"job.sh": JOB},
        input=n,
        template=TEMPLATE,
        timeout=60,
        key=JobKey("core", "soak", "job", run, map_index=n),
    )


def test_core_soak_1000_jobs(rel_server: Any) -> None:
    client = ConnectionConfig(api_url=rel_server.url, api_key=rel_server.api_key).client()
    run = uuid.uuid4().hex
    failures: list[str] = []
    samples: list[tuple[int, int, int]] = []

    def one(n: int) -> None:
        outcome = run_job(client, soak_spec(run, n))
        if not (outcome.ok and outcome.result == {"n": n, "square": n * n}):
            failures.append(f"{n}: {outcome.reason}")

    with ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(one, range(WARMUP)))
        gc.collect()
        rss_warm, fds_warm = rss_and_fds()
        for start in range(WARMUP, TOTAL, 100):
            list(pool.map(one, range(start, min(start + 100, TOTAL))))
            gc.collect()
            samples.append((start + 100, *rss_and_fds()))
    rss_end = samples[-1][1]

    assert failures == [], failures[:10]
    assert rss_end < rss_warm * 1.05, (rss_warm, samples)
    assert max(s[2] for s in samples) <= fds_warm + 2, (fds_warm, samples)
    assert client.sandboxes.list() == []
    # The host holds nothing but the server's warm pool (never used, at most pool_size per template).
    rel_server.wait_for_teardown()
    left = list((Path(rel_server.state_dir) / "sandboxes").iterdir())
    assert len(left) <= 2 * 3, left
