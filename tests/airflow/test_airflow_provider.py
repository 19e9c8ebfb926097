"""Provider registration and the connection, through Airflow's own CLI and the hook."""

from __future__ import annotations

import json

import pytest

from airflow_provider.hooks.pandastack import PandaStackHook, config_from_connection
from airflow_provider.retries import pandastack_retry_policy
from tests.support.dagtest import airflow_cli, connection_env


def test_providers_list_shows_the_provider_and_its_decorator(airflow_db):
    proc = airflow_cli("providers", "list", "--output", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    providers = {p["package_name"]: p for p in json.loads(proc.stdout[proc.stdout.index("[") :])}
    assert "pandastack-workflows" in providers
    hooks = airflow_cli("providers", "hooks", "--output", "json")
    assert "airflow_provider.hooks.pandastack.PandaStackHook" in hooks.stdout
    from airflow.providers_manager import ProvidersManager

    manager = ProvidersManager()
    assert "pandastack" in manager.taskflow_decorators  # @task.pandastack
    # The connection form: relabelled host/password, the retry budget as an extra field.
    assert manager.field_behaviours["pandastack"]["relabeling"] == {"host": "API URL", "password": "API key"}
    assert "extra__pandastack__max_create_retry_seconds" in manager.connection_form_widgets


def test_connections_test_via_cli_succeeds_and_a_wrong_key_fails_without_showing_it(
    airflow_env, local_server
):
    ok = airflow_cli("connections", "test", "pandastack_default")
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    assert "Connection success!" in ok.stdout
    assert local_server.api_key not in ok.stdout + ok.stderr

    wrong_key = "pds_" + "0" * 32
    env = connection_env(local_server, conn_id="pandastack_wrong", key=wrong_key)
    bad = airflow_cli("connections", "test", "pandastack_wrong", env=env)
    assert "Connection success!" not in bad.stdout
    assert "failed" in bad.stdout.lower()
    assert wrong_key not in bad.stdout + bad.stderr


def test_hook_builds_the_client_from_the_connection(airflow_env, local_server, monkeypatch):
    monkeypatch.setenv(
        "AIRFLOW_CONN_PANDASTACK_BAD",
        json.dumps(
            {
                "conn_type": "pandastack",
                "host": "x",
                "password": "pds_" + "a" * 32,
                "extra": {"max_create_retry_seconds": "soon"},
            }
        ),
    )
    hook = PandaStackHook()
    assert hook.config.api_url == local_server.url
    assert hook.config.max_create_retry_seconds == 5
    assert local_server.api_key not in repr(hook.config)
    ok, message = hook.test_connection()
    assert ok, message
    with pytest.raises(ValueError, match="max_create_retry_seconds") as refused:
        _ = PandaStackHook("pandastack_bad").config
    assert "pds_" not in str(refused.value)


def test_bare_host_gets_a_scheme_and_port():
    from airflow.sdk import Connection

    conn = Connection(conn_id="c", conn_type="pandastack", host="sandbox.internal", port=8080, password="k")
    assert config_from_connection(conn).api_url == "https://sandbox.internal:8080"
    conn = Connection(conn_id="c", conn_type="pandastack", host="h", extra=json.dumps({"scheme": "http"}))
    assert config_from_connection(conn).api_url == "http://h"
    assert config_from_connection(None).api_url is None  # the SDK's environment decides


def test_retry_policy_waits_at_least_the_capacity_retry_after():
    from datetime import timedelta

    from airflow.sdk.definitions.retry_policy import RetryAction

    from airflow_provider.exceptions import exception_for
    from pandastack_jobs import FailureClass, FailureKind, JobOutcome

    capacity = JobOutcome(
        ok=False,
        kind=FailureKind.CAPACITY,
        failure_class=FailureClass.REDELIVER,
        reason="no capacity",
        retry_after=15.0,
    )
    error = exception_for(capacity)
    decision = pandastack_retry_policy.evaluate(
        error, 1, 3, {"task": type("T", (), {"retry_delay": timedelta(seconds=2)})()}
    )  # type: ignore[arg-type]
    assert decision.action is RetryAction.RETRY and decision.retry_delay == timedelta(seconds=15)
    decision = pandastack_retry_policy.evaluate(
        error, 1, 3, {"task": type("T", (), {"retry_delay": timedelta(minutes=5)})()}
    )  # type: ignore[arg-type]
    assert decision.action is RetryAction.RETRY and decision.retry_delay is None  # the longer delay stands
    dead = exception_for(
        JobOutcome(ok=False, kind=FailureKind.AUTH, failure_class=FailureClass.DEAD_LETTER, reason="401")
    )
    assert pandastack_retry_policy.evaluate(dead, 1, 3).action is RetryAction.FAIL
    assert pandastack_retry_policy.evaluate(ValueError("x"), 1, 3).action is RetryAction.DEFAULT
