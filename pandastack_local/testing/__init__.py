"""The harness the test suites, ``e2e/`` and ``benchmarks/`` share, importable from the package
(not from ``tests/``, which is no package of the distribution).

Each module imports only what it needs, so nothing here imports Airflow or Prefect:
``waiting`` (one bounded wait), ``procs`` (the one ``/proc`` walker), ``airflow_env`` (a private
Airflow home and an api-server's settings, as environment variables only) and
``executor_stack`` (pandastack-local, an api-server and a scheduler with ``PandaStackExecutor``, as
subprocesses). The server itself as a subprocess is :class:`pandastack_local.LocalServer`; the
in-memory PandaStack is ``pandastack_jobs.testing``.
"""
