"""The distribution's own import name, ``pandastack_workflows``: no code but ``moved`` (old module names).

Airflow finds a provider's example DAGs by importing the module it guesses from the distribution
name (``pandastack-workflows`` → ``pandastack_workflows``); without this package every Airflow
command and task log with the default ``load_examples = True`` carried a ModuleNotFoundError
traceback. The provider itself is ``airflow_provider``, the Prefect collection ``prefect_blocks``.
"""
