"""Renamed modules keep their old import paths (with a DeprecationWarning), and every exception
class of a package derives from that package's one base."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
import warnings
from types import ModuleType

import pytest


def assert_moved(old: str, new: str) -> None:
    """``import old`` warns, names the new module, and gives the new module itself."""
    sys.modules.pop(old, None)
    module = importlib.import_module(new)
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated: import {new}\b"):
        alias = importlib.import_module(old)
    assert alias is module
    parent, _, leaf = old.rpartition(".")
    assert getattr(sys.modules[parent], leaf) is module
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once imported, the old name is cached: no second warning
        assert importlib.import_module(old) is module


def exception_classes(package: str, skip: tuple[str, ...] = ()) -> list[type[BaseException]]:
    """Every exception class defined in ``package``'s modules (but those under ``skip``)."""
    root = importlib.import_module(package)
    names = [package] + [m.name for m in pkgutil.walk_packages(root.__path__, package + ".")]
    found: list[type[BaseException]] = []
    for name in names:
        if name.startswith(skip):
            continue
        module: ModuleType = importlib.import_module(name)
        for value in vars(module).values():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == name:
                found.append(value)
    return found


def test_pandastack_jobs_errors_is_exceptions() -> None:
    assert_moved("pandastack_jobs.errors", "pandastack_jobs.exceptions")
    from pandastack_jobs.errors import JobSpecError  # noqa: F401 - the old spelling a user may have

    with pytest.raises(ImportError):
        importlib.import_module("pandastack_jobs.not_a_module")


def test_jobspec_rules_is_a_deprecated_alias_of_classifier() -> None:
    from pandastack_jobs import Classifier, JobSpec

    spec = JobSpec(command="true", permanent_exit_codes=[3])
    assert isinstance(spec.classifier, Classifier) and spec.classifier.permanent_exit_codes == {3}
    with pytest.warns(DeprecationWarning, match=r"JobSpec\.rules is deprecated: use JobSpec\.classifier"):
        assert spec.rules is spec.classifier


def test_engine_names_are_declared_once_in_the_core() -> None:
    """The values are on the wire (every sandbox's ``job_engine``, what the reapers match):
    they do not change."""
    from pandastack_jobs import Engine

    names = {k: v for k, v in vars(Engine).items() if k.isupper()}
    assert names == {
        "AIRFLOW": "airflow",
        "AIRFLOW_EXECUTOR": "airflow-executor",
        "PREFECT": "prefect",
        "PREFECT_WORKER": "prefect-worker",
        "QUEUE": "queue",
        "CELERY": "celery",
    }


def assert_one_base(
    package: str, base: type[BaseException], skip: tuple[str, ...] = (), foreign: frozenset[str] = frozenset()
) -> None:
    """Every exception class of ``package`` (but under ``skip``, or named in ``foreign``) is a
    ``base``; lists the others."""
    classes = exception_classes(package, skip)
    assert base in classes and len(classes) > 1
    strays = [
        f"{c.__module__}.{c.__qualname__}"
        for c in classes
        if not issubclass(c, base) and c.__name__ not in foreign
    ]
    assert not strays, f"not derived from {base.__name__}: {strays}"


def test_every_core_exception_is_a_pandastack_jobs_error() -> None:
    from pandastack_jobs import JobSpecError, PandaStackJobsError, SandboxGone, WarmupFailed
    from pandastack_jobs.queue.transport import BrokerUnavailable

    assert_one_base("pandastack_jobs", PandaStackJobsError)
    # What they were, they still are (callers catch ValueError, RuntimeError, ConnectionError).
    assert issubclass(JobSpecError, ValueError) and issubclass(SandboxGone, RuntimeError)
    assert issubclass(WarmupFailed, RuntimeError) and issubclass(BrokerUnavailable, ConnectionError)
    assert str(JobSpecError("ttl", "is short", "make it longer")) == "ttl: is short. Fix: make it longer"


def test_every_local_server_exception_is_a_pandastack_local_error() -> None:
    """The guest's own (guest/: standard library only, run inside the sandbox) are the exception."""
    from pandastack_local.exceptions import PandaStackLocalError
    from pandastack_local.isolation.egress import EgressError
    from pandastack_local.templates.registry import TemplateError

    assert_one_base("pandastack_local", PandaStackLocalError, skip=("pandastack_local.guest",))
    assert issubclass(EgressError, ValueError) and issubclass(TemplateError, ValueError)


def hard_coded_loggers(package: str) -> list[str]:
    """``getLogger(...)`` / ``get_logger(...)`` calls of ``package`` whose name is not ``__name__``
    (third-party loggers a module quiets with ``.setLevel`` aside)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[3] / package  # read, not imported: any venv
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("getLogger", "get_logger")
                and node.args
            ):
                continue
            arg = node.args[0]
            if isinstance(arg, ast.Name) and arg.id == "__name__":
                continue
            if isinstance(arg, ast.Constant) and not str(arg.value).startswith(
                ("pandastack", "prefect_blocks", "airflow_provider")
            ):
                continue  # e.g. logging.getLogger("pika").setLevel(...)
            found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


@pytest.mark.parametrize(
    "package", ["pandastack_jobs", "pandastack_local", "airflow_provider", "prefect_blocks"]
)
def test_loggers_are_named_after_their_modules(package: str) -> None:
    assert hard_coded_loggers(package) == []


def test_a_core_log_line_names_its_module_and_does_not_repeat_it(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    import pandastack

    from pandastack_jobs import delete_sandbox
    from pandastack_jobs.testing import FakeClient

    fake = FakeClient()
    sandbox = fake.add_sandbox()
    fake.fail("delete", pandastack.ServerError("busy"), times=None)
    with caplog.at_level(logging.WARNING, logger="pandastack_jobs"):  # the package's level still applies
        assert delete_sandbox(fake, sandbox.id) is False
    [record] = [r for r in caplog.records if "could not delete sandbox" in r.getMessage()]
    assert record.name == "pandastack_jobs.reaper"
    assert record.getMessage().startswith(f"could not delete sandbox {sandbox.id}")


def test_e2e_and_benchmarks_import_the_harness_from_the_package_not_from_tests() -> None:
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    pattern = re.compile(r"^\s*(from|import)\s+tests(\.|\s|$)", re.M)
    offenders = [
        str(path.relative_to(repo))
        for folder in ("e2e", "benchmarks")
        for path in sorted((repo / folder).rglob("*"))
        if path.suffix in (".py", ".sh") and pattern.search(path.read_text())
    ]
    assert offenders == []
