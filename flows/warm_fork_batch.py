"""A warm-fork batch: an expensive warm-up paid once, every job forked from it.

The parent is created and warmed when the ``with`` block starts and deleted
(with any fork a crashed job left) when it ends, even if jobs fail.
"""

from __future__ import annotations

from typing import Any

from _jobs import JOBS_DIR
from prefect import flow, unmapped

from prefect_blocks import run_in_fork, warm_pool


@flow(name="pandastack-warm-fork-batch", log_prints=True)
def warm_fork_batch(items: int = 6) -> list[Any]:
    """Warm one parent, score ``items`` jobs each in its own fork; returns the scores."""
    with warm_pool(
        "python3 warmup.py",
        files={"warmup.py": JOBS_DIR / "warm" / "warmup.py", "score.py": JOBS_DIR / "warm" / "score.py"},
        timeout=60,
    ) as parent:
        scores = run_in_fork.map(
            unmapped(parent), unmapped("python3 score.py"), input=[{"id": i} for i in range(1, items + 1)]
        )
        results = [s.result() for s in scores]
    built = {r["model_built_at"] for r in results}
    print(f"{len(results)} jobs scored from one warm-up (model built once: {len(built) == 1})")
    return results


if __name__ == "__main__":
    warm_fork_batch()
