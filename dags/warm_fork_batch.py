"""A warm-fork batch: an expensive warm-up paid once, every job forked from it.

The setup task boots one parent sandbox and runs the warm-up (2 s here; a model
or a dataset in real life). Each mapped job runs in its own fork of that parent
(a private copy of its disk), and the teardown deletes the parent even when jobs
fail.
"""

from __future__ import annotations

from _jobs import JOBS_DIR, SANDBOX_POOL, example_dag

from airflow_provider.operators.warm_fork import (
    PandaStackForkOperator,
    PandaStackWarmPoolSetupOperator,
    PandaStackWarmPoolTeardownOperator,
)

with example_dag("pandastack_warm_fork_batch", __doc__) as dag:
    warm = PandaStackWarmPoolSetupOperator(
        task_id="warm_up",
        command="python3 warmup.py",
        files={"warmup.py": JOBS_DIR / "warm" / "warmup.py", "score.py": JOBS_DIR / "warm" / "score.py"},
        timeout=60,
    )
    score = PandaStackForkOperator.partial(
        task_id="score",
        parent_id=warm.output,
        command="python3 score.py",
        timeout=30,
        retries=1,
        pool=SANDBOX_POOL,
    ).expand(input=[{"id": i} for i in range(1, 7)])
    cool = PandaStackWarmPoolTeardownOperator(task_id="cool_down", parent_id=warm.output)
    warm >> score >> cool.as_teardown(setups=warm)
