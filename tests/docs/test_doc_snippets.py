"""Issue 25, item 2: every config and code block in the README and docs/ works when pasted.

ini is read the way Airflow reads airflow.cfg (configparser: no inline comments, so a ``# note``
after a value becomes part of it), and the executor's block is loaded by the executor itself;
JSON, Python and shell blocks must parse; connection JSON in ``export AIRFLOW_CONN_...`` too.
"""

from __future__ import annotations

import ast
import configparser
import importlib.util
import json
import os
import shlex
import subprocess
import sys

import pytest

from tests.docs.snippets import ROOT, snippets

NOT_CODE = {"", "text", "console"}  # plain fences hold output, trees, tables


def read_ini(text: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=False)  # as airflow.cfg is read
    parser.read_string(text)
    return parser


def test_every_block_has_a_known_language() -> None:
    langs = {s.lang for s in snippets()} - NOT_CODE
    assert langs <= {"python", "bash", "ini", "json", "toml", "yaml"}, langs


@pytest.mark.parametrize("snippet", snippets("ini"), ids=str)
def test_ini_values_carry_no_comments(snippet) -> None:
    parser = read_ini(snippet.text)
    for section in parser.sections():
        for option, value in parser.items(section, raw=True):
            assert "#" not in value and " ;" not in value, (
                f"{snippet}: [{section}] {option} = {value!r}: a pasted inline comment is part of the value"
            )


@pytest.mark.parametrize("snippet", snippets("python"), ids=str)
def test_python_blocks_parse(snippet) -> None:
    ast.parse(snippet.text, filename=str(snippet))


def parse_data(lang: str, text: str) -> object:
    if lang == "json":
        return json.loads(text)
    if lang == "toml":
        import tomllib

        return tomllib.loads(text)
    import yaml  # PyYAML comes with both engines

    return yaml.safe_load(text)


@pytest.mark.parametrize("snippet", [s for s in snippets() if s.lang in {"json", "toml", "yaml"}], ids=str)
def test_data_blocks_parse(snippet) -> None:
    parse_data(snippet.lang, snippet.text)


@pytest.mark.parametrize("snippet", snippets("bash"), ids=str)
def test_shell_blocks_parse_and_connection_json_is_json(snippet) -> None:
    proc = subprocess.run(["bash", "-n"], input=snippet.text, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"{snippet}: {proc.stderr}"
    for word in shlex.split(snippet.text, comments=True):
        if word.startswith("AIRFLOW_CONN_") and "=" in word:
            value = word.split("=", 1)[1]
            conn = json.loads(value)
            assert conn["conn_type"] == "pandastack", f"{snippet}: {conn}"


def test_no_doc_runs_the_local_server_on_airflows_port() -> None:
    for snippet in snippets():
        for line in snippet.text.splitlines():
            if "pandastack-local serve" in line:
                assert "--port 8080" not in line, f"{snippet}: {line}"


@pytest.mark.skipif(importlib.util.find_spec("airflow") is None, reason="the executor needs Airflow")
@pytest.mark.parametrize(
    "snippet", [s for s in snippets("ini") if "[pandastack_executor]" in s.text], ids=str
)
def test_executor_block_loads_in_the_executor(snippet, tmp_path) -> None:
    """The ``[pandastack_executor]`` block, as airflow.cfg, read by PandaStackExecutor itself."""
    parser = read_ini(snippet.text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__")}
    env["AIRFLOW_HOME"] = str(tmp_path)
    for option, value in parser.items("pandastack_executor", raw=True):
        env[f"AIRFLOW__PANDASTACK_EXECUTOR__{option.upper()}"] = value
    code = (
        "from airflow_provider.executors import PandaStackExecutor\n"
        "e = PandaStackExecutor()\n"
        "c = e.launch_config\n"
        "print('LOADED', c.template, c.timeout_seconds, c.ttl_seconds, dict(c.env), e.poll_interval)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{snippet}: {proc.stderr[-3000:]}"
    (loaded,) = [line for line in proc.stdout.splitlines() if line.startswith("LOADED ")]
    _, template, timeout, ttl, *_ = loaded.split()
    assert template == parser.get("pandastack_executor", "template")
    assert int(ttl) >= int(timeout)


def test_install_commands_name_what_exists() -> None:
    """pandastack-workflows is not on the package index: every pip install in the docs installs from
    a clone ('.[extra]') or the wheel `make wheel` builds, never the distribution by name."""
    from tests.docs.snippets import DOCS

    makefile = (ROOT / "Makefile").read_text()
    assert "\nwheel:" in makefile
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            if "pip install" in line:
                assert "pip install 'pandastack-workflows[" not in line, f"{doc.name}:{number}: {line}"
                assert "pip install pandastack-workflows" not in line, f"{doc.name}:{number}: {line}"
