"""The Airflow operator's queue tests: tests/airflow's isolated AIRFLOW_HOME (set on import, before
anything imports Airflow) and its fixtures, with the brokers of tests/queue."""

from tests.airflow.conftest import airflow_db, airflow_env

__all__ = ["airflow_db", "airflow_env"]
