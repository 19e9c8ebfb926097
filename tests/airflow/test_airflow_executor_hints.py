"""Issue 25, item 6: the executor's first-hour mistakes name the setting to change.

Real tries on a real pandastack-local, as in test_airflow_executor.py: an interpreter that is
not in the sandbox (the default template is not the workers' image: exit 127), a Python without
Airflow, and a sandbox with no egress to the Execution API (connection refused, for real, from
inside the sandbox).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.airflow.test_airflow_executor import _final_event, _log_records, _running_executor, _workload
from tests.support.dagtest import connection_env

CONNECT = """#!/usr/bin/python3
import os, sys, urllib.request
url = os.environ["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"]
urllib.request.urlopen(url + "health", timeout=5)  # what the Task SDK does first, with httpx
"""


@pytest.fixture
def executor_env(airflow_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__POLL_INTERVAL", "0.2")
    monkeypatch.setenv("AIRFLOW__LOGGING__BASE_LOG_FOLDER", str(tmp_path / "logs"))
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTION_API_SERVER_URL", "http://127.0.0.1:8080/execution/")
    return tmp_path / "logs"


def _failed_try(executor_env: Path) -> tuple[str, list[str]]:
    workload = _workload()
    with _running_executor() as executor:
        state, info = _final_event(executor, workload)
    assert str(state) == "failed"
    return info, [r["event"] for r in _log_records(executor_env, workload)]


def test_missing_interpreter_names_template_and_python(executor_env, local_server, monkeypatch) -> None:
    monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__PYTHON", "/opt/airflow-venv/bin/python")
    info, events = _failed_try(executor_env)
    assert "exit code 127" in info
    assert "[pandastack_executor] template" in info and "[pandastack_executor] python" in info, info
    assert any("[pandastack_executor] template" in e for e in events)  # in the task log too
    assert local_server.client().sandboxes.list() == []


def test_python_without_airflow_names_template(executor_env, local_server, monkeypatch) -> None:
    monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__PYTHON", "/usr/bin/python3")
    info, _ = _failed_try(executor_env)
    assert "has no Airflow" in info and "[pandastack_executor] template" in info, info


def test_no_egress_to_the_execution_api_names_allow_egress(
    executor_env, make_local_server, monkeypatch
) -> None:
    # World-readable (the sandbox's root is an unprivileged host uid), outside pytest's 0700 tmp.
    base = Path(tempfile.mkdtemp(prefix="ps-hints-"))
    try:
        os.chmod(base, 0o755)
        code, template = base / "code", base / "template"
        code.mkdir()
        template.mkdir()
        (code / "python").write_text(CONNECT)
        os.chmod(code / "python", 0o755)
        (template / "template.json").write_text(json.dumps({"name": "no-egress", "code_dirs": [str(code)]}))
        server: Any = make_local_server(template_dirs=[str(template)])
        for name, value in connection_env(server).items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__TEMPLATE", "no-egress")
        monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__PYTHON", str(code / "python"))
        info, events = _failed_try(executor_env)
        assert "Connection refused" in "\n".join(events)  # really refused inside the sandbox
        assert "cannot reach the Execution API at http://127.0.0.1:8080/execution/" in info, info
        assert "--allow-egress" in info and "execution_api_server_url" in info
        assert server.client().sandboxes.list() == []
    finally:
        shutil.rmtree(base)
