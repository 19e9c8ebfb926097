"""PandaStack's own client material against a fresh pandastack-local (issue 13 item 4).

The pinned ``pandastack`` sdist is downloaded at test time (``pip download --no-binary pandastack``,
from whatever index the machine's pip configuration names) and extracted; its live end-to-end
tests (``tests/e2e``: enabled by ``PANDASTACK_E2E=1``, pointed at the server by
``PANDASTACK_API``/``PANDASTACK_API_KEY``) and its examples run in subprocesses against a server
of their own. Expected failures, each with its reason, are in ``sdk_expected_failures.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pandastack
import pytest

from pandastack_local import LocalServer

from .sdk_expected_failures import EXPECTED_FAILURES, SDK_VERSION

# How each example shows it worked (it prints, it does not assert): its stdout, last line.
EXAMPLE_OUTPUT = {
    "quickstart.py": "4",
    "code_interpreter.py": "14",
    "browser_scraping.py": "Example Domain",
    "custom_template.py": None,  # passes when it exits 0
}


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("sdist")
    pip = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check"]
    # --no-binary for pandastack alone: its sdist, while its build backend (which pip needs to
    # read the sdist's metadata) comes as a wheel. With ":all:" pip built the backend and its own
    # build requirements from source first: most of this leg's time (290 s of 400 on a loaded
    # machine, against 34 s now).
    run = subprocess.run(
        [*pip, "--no-binary", "pandastack", "--no-deps", f"pandastack=={SDK_VERSION}", "-d", str(dest)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, f"pip download pandastack=={SDK_VERSION} failed:\n{run.stderr[-3000:]}"
    (archive,) = dest.glob("pandastack-*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return dest / f"pandastack-{SDK_VERSION}"


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with LocalServer() as fresh:
        yield fresh


def sdk_env(server: LocalServer, sdist: Path) -> dict[str, str]:
    """The SDK's own configuration (env), and the sdist's source first on the path."""
    return dict(
        os.environ,
        PANDASTACK_API=server.url,
        PANDASTACK_API_KEY=server.api_key,
        PANDASTACK_E2E="1",
        PYTHONPATH=str(sdist / "src"),
    )


def judge(outcomes: dict[str, str | None]) -> list[str]:
    """Each outcome (None: passed, else the failure's text) against the expected failures."""
    problems = []
    for name, failure in sorted(outcomes.items()):
        expected = EXPECTED_FAILURES.get(name)
        if expected is None and failure is not None:
            problems.append(f"{name} failed:\n{failure[-3000:]}")
        elif expected is not None and failure is None:
            problems.append(f"{name} passes now: remove it from sdk_expected_failures.py")
        elif expected is not None and failure is not None and expected.error not in failure:
            problems.append(f"{name} failed, not with {expected.error!r}:\n{failure[-3000:]}")
    return problems


def test_the_pinned_sdk_is_the_one_installed() -> None:
    assert pandastack.__version__ == SDK_VERSION


def test_the_sdks_live_e2e_tests(server: LocalServer, sdist: Path, tmp_path: Path) -> None:
    """``--noconftest``: the sdist's tests/conftest.py points every test's default client at a
    fake host (autouse, for its offline tests), which would send the live tests there too."""
    report = tmp_path / "junit.xml"
    pytest_argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest"]
    subprocess.run(
        [*pytest_argv, "--rootdir", str(sdist), f"--junitxml={report}", "tests/e2e"],
        cwd=sdist,
        env=sdk_env(server, sdist),
        timeout=900,
    )
    outcomes: dict[str, str | None] = {}
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        bad = [c for c in case if c.tag in ("failure", "error", "skipped")]
        outcomes[name] = "\n".join(f"{c.tag}: {c.get('message')}\n{c.text or ''}" for c in bad) or None
    assert outcomes, "the sdist's tests/e2e collected no test"
    assert not (problems := judge(outcomes)), "\n\n".join(problems)


def run_example(server: LocalServer, sdist: Path, script: Path, cwd: Path) -> str | None:
    """Run one example; None if it worked, else what went wrong."""
    cwd.mkdir()
    with tarfile.open(cwd / "rootfs.tar", "w"):  # what custom_template.py uploads
        pass
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=cwd,
        env=sdk_env(server, sdist),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if run.returncode != 0:
        return f"exit {run.returncode}\n{run.stdout[-1000:]}\n{run.stderr[-3000:]}"
    want = EXAMPLE_OUTPUT[script.name]
    printed = (run.stdout.strip().splitlines() or [""])[-1]
    if want is not None and printed != want:
        return f"printed {printed!r}, expected {want!r}\n{run.stderr[-2000:]}"
    return None


def test_the_sdks_examples(server: LocalServer, sdist: Path, tmp_path: Path) -> None:
    scripts = sorted((sdist / "examples").glob("*.py"))
    assert {s.name for s in scripts} == set(EXAMPLE_OUTPUT), "an example was added or removed"
    outcomes = {f"examples/{s.name}": run_example(server, sdist, s, tmp_path / s.stem) for s in scripts}
    assert not (problems := judge(outcomes)), "\n\n".join(problems)


def test_code_interpreter_example_with_a_path_that_exists(
    server: LocalServer, sdist: Path, tmp_path: Path
) -> None:
    """The example's pandas + matplotlib code, its chart saved under /tmp instead of /home/panda."""
    source = (sdist / "examples" / "code_interpreter.py").read_text()
    assert source.count("/home/panda/squares.png") == 2
    script = tmp_path / "code_interpreter.py"
    script.write_text(source.replace("/home/panda/squares.png", "/tmp/squares.png"))
    assert run_example(server, sdist, script, tmp_path / "run") is None
    png = (tmp_path / "run" / "squares.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
