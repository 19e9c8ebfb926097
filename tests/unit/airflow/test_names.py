"""The provider's renamed modules keep their old import paths, and its exceptions share one base."""

from __future__ import annotations

import pytest

from tests.unit.core.test_names import assert_moved, assert_one_base

# The executor's driver contract is Airflow common.sandbox's, exceptions included: imported from it
# when it is installed, else its local copy (the same tree, rooted in its own SandboxError), so
# those are not the provider's to re-parent.
CONTRACT = frozenset({"SandboxConfigurationError", "SandboxInvalidHandleError"})
# A warning category (for filters, raised by nothing): versions.py runs before Airflow is imported,
# and the provider's base error derives from Airflow's.
VERSION_WARNING = frozenset({"UntestedAirflowWarning"})
CONTRACT_MODULES = (
    "airflow_provider.executors._contract_local",
    "airflow_provider.executors._contract_errors_local",
)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("airflow_provider.operators.pool", "airflow_provider.operators.warm_fork"),
        ("airflow_provider.operators.job", "airflow_provider.operators.base"),
        ("airflow_provider.retry", "airflow_provider.retries"),
    ],
)
def test_old_module_paths_warn_and_are_the_new_modules(old: str, new: str) -> None:
    assert_moved(old, new)


def test_a_dag_written_against_the_old_paths_gets_the_same_classes() -> None:
    from airflow_provider.operators.pool import PandaStackForkOperator
    from airflow_provider.retry import pandastack_retry_policy

    from airflow_provider.operators.warm_fork import PandaStackForkOperator as New
    from airflow_provider.retries import pandastack_retry_policy as new_policy

    assert PandaStackForkOperator is New and New.__module__ == "airflow_provider.operators.warm_fork"
    assert pandastack_retry_policy is new_policy


def test_provider_info_names_the_new_modules() -> None:
    from airflow_provider.get_provider_info import get_provider_info

    modules = get_provider_info()["operators"][0]["python-modules"]
    assert "airflow_provider.operators.warm_fork" in modules
    assert not any(m.endswith((".pool", ".job")) for m in modules)


def test_every_provider_exception_is_a_pandastack_airflow_error() -> None:
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    from airflow_provider.exceptions import (
        PandaStackAirflowError,
        PandaStackJobDeadLetter,
        PandaStackJobRedeliver,
    )
    from airflow_provider.executors.models import SandboxConfigurationError
    from airflow_provider.hooks.pandastack import PandaStackConnectionError

    assert_one_base(
        "airflow_provider", PandaStackAirflowError, skip=CONTRACT_MODULES, foreign=CONTRACT | VERSION_WARNING
    )
    # Airflow's reading of them is unchanged: redeliver retries, dead-letter fails at once.
    assert issubclass(PandaStackJobRedeliver, AirflowException)
    assert not issubclass(PandaStackJobRedeliver, AirflowFailException)
    assert issubclass(PandaStackJobDeadLetter, AirflowFailException)
    assert issubclass(PandaStackConnectionError, ValueError) and issubclass(
        SandboxConfigurationError, ValueError
    )
