"""Helpers shared by the test suites, e2e and benchmarks.

Each module imports only what it needs, so the core-only suites never import Airflow or Prefect:
``server`` (local server fixtures, leak guard), ``procs`` (the one ``/proc`` walker),
``airflow_env`` and ``dagtest`` (Airflow), ``prefect_readback`` (Prefect).
"""
