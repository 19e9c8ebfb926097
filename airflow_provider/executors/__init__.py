"""``PandaStackExecutor``: every Airflow task try in its own throwaway PandaStack sandbox.

Configure ``[core] executor = airflow_provider.executors.PandaStackExecutor`` (alone, or
beside others: ``CeleryExecutor,airflow_provider.executors.PandaStackExecutor``, and
``executor="PandaStackExecutor"`` on a task). See docs/airflow.md, section "Executor".
"""

from .pandastack_executor import PandaStackExecutor

__all__ = ["PandaStackExecutor"]
