"""Issue 36: the ``[pandastack_executor]`` options are declared once (the provider info's ``config``,
as Airflow's providers declare theirs), read all at once with one error naming each bad option, and a
task's portable ``executor_config["sandbox"]`` is read as well as ``"pandastack"``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from airflow_provider.executors.launch import PandaStackLaunchConfig, task_options
from airflow_provider.executors.models import SandboxConfigurationError
from airflow_provider.executors.options import OPTIONS, SECTION, read_section
from airflow_provider.get_provider_info import get_provider_info

ROOT = Path(__file__).resolve().parents[3]
EXECUTORS = ROOT / "airflow_provider" / "executors"
READS_AN_OPTION = r"get\(\s*(section|self\.config_section)\s*,\s*[\"']"


def test_the_provider_info_declares_every_option_with_airflows_fields() -> None:
    section = get_provider_info()["config"][SECTION]
    assert list(section["options"]) == [o.name for o in OPTIONS]
    for name, declared in section["options"].items():
        assert set(declared) == {"description", "version_added", "type", "example", "default"}, name
        assert declared["type"] in {"string", "integer", "float", "boolean"} and declared["description"]


def test_no_module_but_the_declaration_reads_the_section() -> None:
    # The executor reads options only through options.read_section (launch.py reads the job options
    # by options.TASK_OPTIONS): a get(section, "name") anywhere else would be an undeclared option.
    readers = [
        path.name
        for path in EXECUTORS.glob("*.py")
        if path.name != "options.py" and re.search(READS_AN_OPTION, path.read_text())
    ]
    assert readers == []


def test_the_docs_configuration_block_lists_exactly_the_declared_options() -> None:
    text = (ROOT / "docs" / "airflow.md").read_text()
    block = text.split("[pandastack_executor]\n", 1)[1].split("```", 1)[0]
    documented = {m.group(1) for m in re.finditer(r"^#? ?([a-z_]+) = ", block, re.MULTILINE)}
    assert documented == {o.name for o in OPTIONS}


def test_defaults_are_used_where_nothing_is_set() -> None:
    values, problems = read_section(lambda section, option, fallback=None: None)
    assert problems == []
    assert values["poll_interval"] == 1.0 and values["launch_concurrency"] == 8
    assert values["check_health_on_startup"] is True and values["warm_pool_size"] == 0
    assert values["pandastack_conn_id"] == "pandastack_default" and values["python"] is None


def test_every_bad_option_is_named_in_one_error(monkeypatch: pytest.MonkeyPatch, logs: Path) -> None:
    from airflow_provider.executors import PandaStackExecutor

    bad = {
        "POLL_INTERVAL": "fast",
        "LAUNCH_CONCURRENCY": "0",
        "SHUTDOWN_TIMEOUT": "-1",
        "CHECK_HEALTH_ON_STARTUP": "maybe",
        "WARM_POOL_SIZE": "many",
        "TIMEOUT": "soon",
        "POL_INTERVAL": "2",  # a typo: nothing would read it
    }
    for name, value in bad.items():
        monkeypatch.setenv(f"AIRFLOW__PANDASTACK_EXECUTOR__{name}", value)
    with pytest.raises(SandboxConfigurationError) as caught:
        PandaStackExecutor()
    message = str(caught.value)
    assert message.startswith("[pandastack_executor]: 7 bad options; fix each:")
    assert "poll_interval: 'fast' is not a number of seconds > 0, e.g. 1" in message
    assert "launch_concurrency: '0' is not a whole number > 0" in message
    assert "shutdown_timeout: '-1' is not a number of seconds >= 0" in message
    assert "check_health_on_startup: 'maybe' is not True or False" in message
    assert "warm_pool_size: 'many' is not a whole number from 0 to 64" in message
    assert "timeout: 'soon' is not a positive number" in message
    assert "pol_interval: not an option of this executor; the options are" in message


def test_one_bad_option_is_still_a_configuration_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, logs: Path
) -> None:
    from airflow_provider.executors import PandaStackExecutor

    monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__ADOPTION_TIMEOUT", "1,5")
    with pytest.raises(SandboxConfigurationError, match=r"(?s)1 bad option;.*adoption_timeout: '1,5'"):
        PandaStackExecutor()


def test_the_portable_sandbox_key_is_read_in_this_executors_names() -> None:
    assert task_options({"sandbox": {"timeout_seconds": 600, "ttl_seconds": 900, "env": {"A": "1"}}}) == {
        "timeout": 600,
        "ttl": 900,
        "env": {"A": "1"},
    }
    both = {
        "sandbox": {"timeout_seconds": 600, "env": {"A": "1", "B": "1"}},
        "pandastack": {"env": {"B": "2"}},
    }
    assert task_options(both) == {"timeout": 600, "env": {"A": "1", "B": "2"}}
    config = PandaStackLaunchConfig().overlay({"sandbox": {"timeout_seconds": 120}})
    assert (config.timeout_seconds, config.ttl_seconds) == (120, 180)
    assert task_options({"sandbox": {"keep": False, "workdir": None}}) == {}


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"keep": True}, r"executor_config\['sandbox'\]: keep: PandaStackExecutor deletes every try's"),
        ({"workdir": "/srv"}, r"executor_config\['sandbox'\]: workdir: .* leave workdir out"),
        ({"cpus": 2}, r"executor_config\['sandbox'\]: unknown option\(s\) cpus; use env, keep"),
        ({"timeout_seconds": "soon"}, r"executor_config\['sandbox'\]: timeout: 'soon' is not a positive"),
    ],
)
def test_a_bad_portable_option_is_refused_naming_it(given: dict[str, Any], named: str) -> None:
    with pytest.raises(SandboxConfigurationError, match=named):
        task_options({"sandbox": given})
