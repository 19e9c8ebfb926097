"""Helpers shared by the test suites (what e2e and the benchmarks share too is in
``pandastack_local.testing``: the bounded wait, the ``/proc`` walker, the Airflow environment and
the executor stack).

Each module imports only what it needs, so the core-only suites never import Airflow or Prefect:
``server`` (local server fixtures, leak guard), ``dagtest`` (Airflow), ``prefect_fixtures`` and
``prefect_readback`` (Prefect).
"""
