"""Provider registration: what ``airflow providers list`` and the connection form read.

Loaded through the ``apache_airflow_provider`` entry point declared in
``pyproject.toml``. Keep this module import-light: Airflow imports it while it
discovers providers, before any hook or operator is needed.
"""

from __future__ import annotations

from typing import Any

PACKAGE_NAME = "pandastack-workflows"
INTEGRATION = "PandaStack"


def _version() -> str:
    try:
        from importlib.metadata import version

        return version(PACKAGE_NAME)
    except Exception:  # noqa: BLE001 - an uninstalled checkout still registers
        return "0.0.0"


def get_provider_info() -> dict[str, Any]:
    from airflow_provider.executors.options import provider_config

    return {
        "package-name": PACKAGE_NAME,
        "name": "PandaStack",
        "description": (
            "Run every Airflow task in its own throwaway PandaStack sandbox (microVM): "
            "a hook and connection type, PandaStackSandboxOperator, @task.pandastack, "
            "a deferrable trigger and warm-fork pool operators."
        ),
        "versions": [_version()],
        "integrations": [
            {
                "integration-name": INTEGRATION,
                "external-doc-url": "https://pandastack.ai",
                "tags": ["service"],
            }
        ],
        "hooks": [{"integration-name": INTEGRATION, "python-modules": ["airflow_provider.hooks.pandastack"]}],
        "operators": [
            {
                "integration-name": INTEGRATION,
                "python-modules": [
                    "airflow_provider.operators.sandbox",
                    "airflow_provider.operators.warm_fork",
                ],
            }
        ],
        "triggers": [
            {"integration-name": INTEGRATION, "python-modules": ["airflow_provider.triggers.sandbox"]}
        ],
        "executors": ["airflow_provider.executors.PandaStackExecutor"],
        # The [pandastack_executor] options, declared once (executors/options.py).
        "config": provider_config(),
        "cli": ["airflow_provider.executors.cli.get_cli_commands"],
        "task-decorators": [
            {"name": "pandastack", "class-name": "airflow_provider.decorators.pandastack.pandastack_task"}
        ],
        "connection-types": [
            {
                "connection-type": "pandastack",
                "hook-class-name": "airflow_provider.hooks.pandastack.PandaStackHook",
                "hook-name": "PandaStack",
                "conn-fields": {
                    "max_create_retry_seconds": {
                        "label": "Create retry budget (seconds)",
                        "schema": {"type": ["number", "null"], "minimum": 0},
                        "description": (
                            "How long sandbox creates keep retrying capacity refusals (429/503/507) "
                            "before the task is redelivered by Airflow. Empty: the SDK default (60 s)."
                        ),
                    },
                    "request_timeout": {
                        "label": "Request timeout (seconds)",
                        "schema": {"type": ["number", "null"], "minimum": 1},
                        "description": "Per-request HTTP timeout for API calls other than exec. Default 30.",
                    },
                },
                "ui-field-behaviour": {
                    "hidden-fields": ["schema", "login", "port"],
                    "relabeling": {"host": "API URL", "password": "API key"},
                    "placeholders": {
                        "host": "https://api.pandastack.ai",
                        "password": "pds_...",
                        "extra": '{"max_create_retry_seconds": 60}',
                    },
                },
            }
        ],
    }
