"""On the floor Airflows (3.1, 3.2): the operator, @task.pandastack, the hook and the trigger import and
work, a crash is redelivered in a fresh sandbox, a permanent exit code is not; the executor refuses
with the version it needs."""

from __future__ import annotations

from datetime import timedelta

import pendulum
import pytest


def register(dag) -> None:
    """Serialize ``dag`` into the metadata DB, as tests.support.dagtest does on 3.3 (paths moved)."""
    import os
    from pathlib import Path

    from airflow.dag_processing.bundles.manager import DagBundlesManager

    try:
        from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db
    except ImportError:  # Airflow < 3.3
        from airflow.models.dagbag import DagBag, sync_bag_to_db  # type: ignore[no-redef]

    DagBundlesManager().sync_bundles_to_db()
    bag = DagBag(dag_folder=str(Path(os.environ["AIRFLOW_HOME"]) / "dags"))
    bag.bag_dag(dag)
    sync_bag_to_db(bag, "dags-folder", None)


# A whole dag.test() on the floor engine: 80 s on a loaded machine, past pytest's default 300 s when
# the machine is far over its two cores (the second timed CI run: load 30-80, CPU-bound inside
# Airflow's own start-up). The limit catches a hang; CI's per-leg times catch slowness.
@pytest.mark.timeout(900)
def test_operator_decorator_redelivery_and_dead_letter(airflow_env, local_server) -> None:
    from airflow.sdk import DAG, task

    from airflow_provider.operators.sandbox import PandaStackSandboxOperator
    from airflow_provider.triggers.sandbox import PandaStackJobTrigger  # noqa: F401 - imports on the floor
    from tests.support.dagtest import task_instances, xcom

    with DAG("floor", schedule=None, start_date=pendulum.datetime(2024, 1, 1, tz="UTC")) as dag:
        PandaStackSandboxOperator(
            task_id="crash", command="exit 1", result_path=None, timeout=30,
            retries=1, retry_delay=timedelta(seconds=1),
        )  # fmt: skip
        PandaStackSandboxOperator(
            task_id="permanent", command="exit 3", permanent_exit_codes=[3], result_path=None,
            timeout=30, retries=2, retry_delay=timedelta(seconds=1),
        )  # fmt: skip

        @task.pandastack(timeout=60)
        def double(x: int) -> int:
            return 2 * x

        double(21)
    register(dag)
    dr = dag.test(logical_date=None)
    tis = task_instances(dr)
    assert (tis[("crash", -1)].state, tis[("crash", -1)].try_number) == ("failed", 2)  # redelivered once
    assert (tis[("permanent", -1)].state, tis[("permanent", -1)].try_number) == ("failed", 1)
    assert tis[("double", -1)].state == "success" and xcom(dr, "double") == 42
    assert local_server.client().sandboxes.list() == []


def test_no_dependency_here_breaks_this_airflow() -> None:
    import warnings

    from airflow_provider.versions import check_airflow

    with warnings.catch_warnings():  # on 3.2: constraints/airflow-3.2.txt caps fastapi and svcs
        warnings.simplefilter("error")
        check_airflow()


def test_executor_says_it_needs_33() -> None:
    from airflow_provider.versions import airflow_release

    if airflow_release() >= (3, 3):
        pytest.fail("the floor leg runs an Airflow older than 3.3")
    with pytest.raises(ImportError, match=r"apache-airflow>=3\.3"):
        from airflow_provider.executors import PandaStackExecutor  # noqa: F401
