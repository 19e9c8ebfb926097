"""The PandaStack provider for Apache Airflow 3.1-3.3 (the executor: 3.3).

Importing it on an Airflow outside that range fails at once, naming the range (versions.py).
"""

from __future__ import annotations

from .versions import check_airflow

check_airflow()
