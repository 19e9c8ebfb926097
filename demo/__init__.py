"""``make demo``: the example DAGs and flows, end to end, on the embedded local PandaStack server.

The same runners are used by the example tests (``tests/airflow/test_examples.py``,
``tests/prefect/test_examples.py``), so what the demo shows is what CI checks.
"""
