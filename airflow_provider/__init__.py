"""The PandaStack provider for Apache Airflow 3.1 and newer (tested on 3.1-3.3; the executor: 3.3).

Importing it below 3.1 fails at once naming the floor; above the newest tested minor it warns once,
naming the tested range (versions.py).
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
