"""The test suites, as packages: ``tests.support`` is shared by every suite, e2e and benchmarks.

Packages (not rootless directories) so that ``tests/airflow`` and ``tests/prefect`` never shadow
the real ``airflow`` and ``prefect`` on ``sys.path``.
"""
