"""The setting to change, for the two executor mistakes a newcomer makes first.

Both failures otherwise surface as a bare exit code or a connection error deep in the Task SDK's
output: the sandbox has no Python with Airflow (the default template is not the workers' image),
or the sandbox cannot reach the Execution API (no egress to it).
"""

from __future__ import annotations

from .models import SandboxResult

SECTION = "[pandastack_executor]"
NOT_FOUND = ("not found", "No such file or directory", "can't open file")
NO_AIRFLOW = ("No module named 'airflow'", 'No module named "airflow"')
UNREACHABLE = ("Connection refused", "ConnectError", "Network is unreachable", "Name or service not known")


def failure_hint(result: SandboxResult, output: str, python: str, execution_api_url: str) -> str | None:
    """One sentence naming the setting behind a failed try, or None when nothing is recognised."""
    missing = any(s in output for s in NOT_FOUND) or not output.strip()
    if result.exit_code in (126, 127) and missing:
        return (
            f"the sandbox has no interpreter at {python!r}: set {SECTION} template to a template "
            "that carries the workers' Python environment (python_env) and DAGs (code_dirs), and "
            f"{SECTION} python to its interpreter as the sandbox sees it (docs/airflow.md, Executor)"
        )
    if any(s in output for s in NO_AIRFLOW):
        return (
            f"the sandbox's Python ({python!r}) has no Airflow: set {SECTION} template to a template "
            f"with the workers' environment, and {SECTION} python to its interpreter"
        )
    if any(s in output for s in UNREACHABLE):
        return (
            f"the sandbox cannot reach the Execution API at {execution_api_url}: allow it from the "
            "sandbox's network (pandastack-local: serve --allow-egress HOST:PORT of the api-server; "
            f"hosted PandaStack: make it reachable) and set {SECTION} execution_api_server_url to the "
            "address the sandbox sees"
        )
    return None
