"""The PandaStack provider for Apache Airflow 3.1-3.3 (the executor: 3.3).

Importing it on an Airflow outside that range fails at once, naming the range (versions.py).
"""

from __future__ import annotations

from pandastack_workflows.moved import register

from .versions import check_airflow

check_airflow()
register(
    {
        "airflow_provider.operators.pool": "airflow_provider.operators.warm_fork",
        "airflow_provider.operators.job": "airflow_provider.operators.base",
        "airflow_provider.retry": "airflow_provider.retries",
    }
)
