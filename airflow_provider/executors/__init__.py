"""``PandaStackExecutor``: every Airflow task try in its own throwaway PandaStack sandbox.

Configure ``[core] executor = airflow_provider.executors.PandaStackExecutor`` (alone, or
beside others: ``CeleryExecutor,airflow_provider.executors.PandaStackExecutor``, and
``executor="PandaStackExecutor"`` on a task). See docs/airflow.md, section "Executor".

The executor is imported on first use, so the CLI and provider discovery, which import
this package, stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .pandastack_executor import PandaStackExecutor

__all__ = ["PandaStackExecutor"]


def __getattr__(name: str) -> Any:
    if name == "PandaStackExecutor":
        from airflow_provider.versions import check_executor

        check_executor()  # on Airflow 3.1/3.2: a clear ImportError at scheduler start-up
        from .pandastack_executor import PandaStackExecutor

        return PandaStackExecutor
    raise AttributeError(name)
