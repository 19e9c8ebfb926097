"""The executor's launch options are the core's: read and checked by ``JobSpec``'s declaration,
with the core's one TTL rule (``JobSpec.ttl_seconds``: explicit, else timeout + TTL_MARGIN_SECONDS)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from airflow_provider.executors.launch import TASK_OPTIONS, PandaStackLaunchConfig
from airflow_provider.executors.models import SandboxConfigurationError
from airflow_provider.executors.testing import FakeSandboxDriver
from pandastack_jobs import JobSpec, option_names
from pandastack_jobs.spec import TTL_MARGIN_SECONDS
from tests.unit.airflow.executor_support import final_event, workload


def core_ttl(timeout: int, ttl: int | None = None) -> int:
    return JobSpec(command=":", timeout=timeout, ttl=ttl).ttl_seconds


def test_the_task_options_are_options_of_the_core() -> None:
    assert set(TASK_OPTIONS) <= set(option_names())


def test_the_default_ttl_is_the_cores_rule(logs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor's margin was timeout + 300, the core's timeout + 60: now one rule."""
    from airflow_provider.executors import PandaStackExecutor

    config = PandaStackExecutor().launch_config
    assert config.ttl_seconds == core_ttl(3600) == 3600 + TTL_MARGIN_SECONDS
    monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__TIMEOUT", "90")
    assert PandaStackExecutor().launch_config.ttl_seconds == core_ttl(90)


def test_a_task_timeout_gets_the_cores_ttl_in_the_launch_request(
    executor: Any, driver: FakeSandboxDriver
) -> None:
    wl = workload(executor_config={"pandastack": {"timeout": 600}})
    executor.queue_workload(wl, session=None)
    final_event(executor, wl.ti.key)
    request = driver.launched[0]
    assert (request.timeout_seconds, request.ttl_seconds) == (600, core_ttl(600))


def test_an_explicit_ttl_is_kept_while_it_covers_the_timeout() -> None:
    base = PandaStackLaunchConfig(timeout_seconds=100, ttl=10_000)
    assert base.ttl_seconds == 10_000
    assert base.overlay({"pandastack": {"timeout": 600}}).ttl_seconds == 10_000
    assert base.overlay({"pandastack": {"timeout": 20_000}}).ttl_seconds == core_ttl(20_000)
    assert base.overlay({"pandastack": {"ttl": 700}}).ttl_seconds == 700
    assert base.overlay(None) == base and base.overlay({"pandastack": {}}) == base


def test_the_section_is_read_by_the_cores_declaration(monkeypatch: pytest.MonkeyPatch, logs: Path) -> None:
    from airflow_provider.executors import PandaStackExecutor

    monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__TIMEOUT", "120")
    monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__TTL", "500")
    monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__ENV", '{"TZ": "UTC", "N": 3}')
    monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__TEMPLATE", "airflow-worker")
    c = PandaStackExecutor().launch_config
    assert (c.template, c.timeout_seconds, c.ttl_seconds, dict(c.env)) == (
        "airflow-worker",
        120,
        500,
        {"TZ": "UTC", "N": "3"},  # numbers become strings, as the core reads an env mapping
    )


@pytest.mark.parametrize(
    ("option", "value", "match"),
    [
        ("TIMEOUT", "soon", r"\[pandastack_executor\]: timeout: 'soon' is not a positive number"),
        ("TIMEOUT", "1.5", "not a whole number of seconds"),
        ("TTL", "30", r"ttl: 30 is shorter than the timeout"),
        ("ENV", "TZ=UTC", r"env: 'TZ=UTC' is a string, not a mapping"),
        ("ENV", '{"AIRFLOW__CORE__X": "1"}', "reserved Airflow variables"),
        ("TEMPLATE", "no/such", "template: 'no/such' is not a valid template name"),
    ],
)
def test_a_bad_section_value_stops_the_executor_with_the_cores_message(
    option: str, value: str, match: str, monkeypatch: pytest.MonkeyPatch, logs: Path
) -> None:
    from airflow_provider.executors import PandaStackExecutor

    monkeypatch.setenv(f"AIRFLOW__PANDASTACK_EXECUTOR__{option}", value)
    with pytest.raises(SandboxConfigurationError, match=match):
        PandaStackExecutor()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"env": {"AIRFLOW__CORE__SQL_ALCHEMY_CONN": "x"}}, "reserved Airflow variables"),
        ({"env": {"airflow_home": "x"}}, "reserved Airflow variables"),
        ({"env": {"BAD-NAME": "x"}}, r"env\['BAD-NAME'\]: is not a valid variable name"),
        ({"timeout": 0}, "timeout: 0 is not a positive number"),
        ({"timeout": 2.5}, "not a whole number of seconds"),
        ({"ttl": "long"}, "ttl"),
        ({"image": "x"}, "unknown option"),
    ],
)
def test_task_options_refused_with_the_cores_message(options: dict[str, Any], match: str) -> None:
    with pytest.raises(SandboxConfigurationError, match=match):
        PandaStackLaunchConfig().overlay({"pandastack": options})


def test_a_task_ttl_shorter_than_its_timeout_is_refused() -> None:
    with pytest.raises(SandboxConfigurationError, match="shorter than the timeout"):
        PandaStackLaunchConfig(timeout_seconds=100).overlay({"pandastack": {"timeout": 1000, "ttl": 10}})
