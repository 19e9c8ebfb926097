"""Issue 25, item 8 and issue 36: an engine below its floor fails at import naming the floor, one newer
than the tested minors imports with one warning naming the tested range, and the floors are the ones
pyproject's extras declare (where pip enforces them), with no cap."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import warnings
from functools import partial
from pathlib import Path
from types import ModuleType

import pytest
import tomllib

from tests.docs.snippets import ROOT


def _load(path: str) -> ModuleType:
    """The import-light versions module alone (its package imports the engine, maybe absent here)."""
    spec = importlib.util.spec_from_file_location(path.replace("/", "_"), ROOT / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_AF, _PF = _load("airflow_provider/versions.py"), _load("prefect_blocks/versions.py")
AIRFLOW_RANGE, check_airflow, check_executor = _AF.SUPPORTED_TEXT, _AF.check_airflow, _AF.check_executor
PREFECT_RANGE, check_prefect = _PF.SUPPORTED_TEXT, _PF.check_prefect


def test_extras_declare_the_supported_ranges() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    engine = {
        name: [r for r in extras[name] if r.startswith(name.replace("airflow", "apache-airflow"))]
        for name in ("airflow", "prefect")
    }
    assert engine == {"airflow": [AIRFLOW_RANGE], "prefect": [PREFECT_RANGE]}


# Each engine's check: versions below its floor (the refusal names the floor), versions tested.
RANGES = [
    # installed={}: the 3.2 pins warning is its own test below
    (
        partial(check_airflow, installed={}),
        r"apache-airflow>=3\.1;",
        [(3, 0), (2, 11)],
        [(3, 1), (3, 2), (3, 3)],
    ),
    (check_prefect, r"prefect>=3\.6;", [(3, 5), (2, 20)], [(3, 6), (3, 8), (3, 9)]),
]


@pytest.mark.parametrize(("check", "named", "found"), [(c, n, v) for c, n, out, _ in RANGES for v in out])
def test_an_engine_below_its_floor_is_refused(check, named, found) -> None:
    with pytest.raises(ImportError, match=named):
        check(found)


@pytest.mark.parametrize(("check", "found"), [(c, v) for c, _, _, inside in RANGES for v in inside])
def test_a_tested_engine_passes_without_a_warning(check, found) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check(found)


@pytest.mark.parametrize(
    ("check", "found", "tested"),
    [
        (check_airflow, (3, 4), "Airflow 3.1 to 3.3"),
        (check_airflow, (4, 0), "Airflow 3.1 to 3.3"),
        (check_prefect, (3, 10), "Prefect 3.6 to 3.9"),
    ],
)
def test_a_newer_engine_is_let_through_with_the_tested_range(check, found, tested) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check(found)
    assert [str(w.message).split(";")[0].rsplit(" on ", 1)[1] for w in caught] == [tested]


@pytest.mark.parametrize("found", [(3, 1), (3, 2), (3, 3)])
def test_airflow_in_the_range_with_its_pins_warns_nothing(found) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_airflow(found, {"fastapi": "0.136.3", "svcs": "26.1.0"})


def test_airflow_32_next_to_what_breaks_it_warns_with_the_fix() -> None:
    with pytest.warns(RuntimeWarning, match=r"fastapi 0\.165\.0, svcs 26\.2\.0") as caught:
        check_airflow((3, 2), {"fastapi": "0.165.0", "svcs": "26.2.0"})
    assert "pip install 'fastapi<0.137' 'svcs<26.2'" in str(caught[0].message)
    with pytest.warns(RuntimeWarning, match=r"has svcs 26\.2\.0, with"):
        check_airflow((3, 2), {"fastapi": "0.136.3", "svcs": "26.2.0"})
    with warnings.catch_warnings():  # 3.3 ties the lifespan to the transport and caps fastapi itself
        warnings.simplefilter("error")
        check_airflow((3, 3), {"fastapi": "0.136.3", "svcs": "26.2.0"})


def test_executor_needs_33() -> None:
    with pytest.raises(ImportError, match=r"apache-airflow>=3\.3"):
        check_executor((3, 2))
    check_executor((3, 3))


@pytest.mark.parametrize(
    ("dist", "ver", "module", "expected"),
    [
        ("apache_airflow", "3.0.6", "airflow_provider", "apache-airflow>=3.1"),
        ("prefect", "3.5.2", "prefect_blocks", "prefect>=3.6"),
    ],
)
def test_import_on_an_unsupported_install_fails_at_once(tmp_path: Path, dist, ver, module, expected) -> None:
    # What an installed older engine looks like to importlib.metadata (first on the path wins).
    info = tmp_path / f"{dist}-{ver}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: {ver}\n")
    code = f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {str(ROOT)!r}]; import {module}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError") and expected in last and ver.rsplit(".", 1)[0] in last, last


def test_import_on_a_newer_airflow_warns_once_naming_the_tested_range(tmp_path: Path) -> None:
    # Airflow 3.4.0, as importlib.metadata sees it; the provider's package imports no Airflow itself.
    info = tmp_path / "apache_airflow-3.4.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: apache-airflow\nVersion: 3.4.0\n")
    code = f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {str(ROOT)!r}]; import airflow_provider"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "Warning:" in line]
    assert len(warned) == 1 and "UntestedAirflowWarning" in warned[0], proc.stderr
    assert "tested on Airflow 3.1 to 3.3; this is Airflow 3.4" in warned[0]
