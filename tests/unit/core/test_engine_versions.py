"""Issue 36: an engine newer than the tested minors imports with one warning naming the tested range,
read from importlib.metadata as on a real install (faked here: no Airflow 3.4 or Prefect 3.10 in the
venvs). The versions modules are loaded from their files: each package's own import pulls its engine."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("unit_" + path.replace("/", "_"), ROOT / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


AIRFLOW, PREFECT = _load("airflow_provider/versions.py"), _load("prefect_blocks/versions.py")


def _installed(monkeypatch: pytest.MonkeyPatch, module: ModuleType, versions: dict[str, str]) -> None:
    def version(name: str) -> str:
        if name not in versions:
            raise module.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(module, "version", version)


@pytest.mark.parametrize(
    ("module", "check", "dist", "newer", "category", "tested"),
    [
        (AIRFLOW, "check_airflow", "apache-airflow", "3.4.0", "UntestedAirflowWarning", "Airflow 3.1 to 3.3"),
        (
            AIRFLOW,
            "check_airflow",
            "apache-airflow",
            "4.1.0rc1",
            "UntestedAirflowWarning",
            "Airflow 3.1 to 3.3",
        ),
        (PREFECT, "check_prefect", "prefect", "3.10.2", "UntestedPrefectWarning", "Prefect 3.6 to 3.9"),
    ],
)
def test_a_newer_installed_engine_warns_once_and_is_not_refused(
    monkeypatch: pytest.MonkeyPatch, module, check, dist, newer, category, tested
) -> None:
    _installed(monkeypatch, module, {dist: newer})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        getattr(module, check)()
    assert [type(w.message).__name__ for w in caught] == [category]
    message = str(caught[0].message)
    assert f"tested on {tested}" in message and newer.rsplit(".", 1)[0] in message


@pytest.mark.parametrize(
    ("module", "check", "dist", "tested"),
    [
        (AIRFLOW, "check_airflow", "apache-airflow", "3.3.2"),
        (AIRFLOW, "check_airflow", "apache-airflow", "3.1.8"),
        (PREFECT, "check_prefect", "prefect", "3.9.1"),
        (PREFECT, "check_prefect", "prefect", "3.6.29"),
    ],
)
def test_a_tested_engine_imports_in_silence(
    monkeypatch: pytest.MonkeyPatch, module, check, dist, tested
) -> None:
    _installed(monkeypatch, module, {dist: tested})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        getattr(module, check)()


def test_the_extras_set_a_floor_and_no_cap() -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "apache-airflow>=3.1" in extras["airflow"] and "prefect>=3.6" in extras["prefect"]
    assert not [
        r
        for r in extras["airflow"] + extras["prefect"]
        if r.startswith(("apache-airflow", "prefect")) and "<" in r
    ]
