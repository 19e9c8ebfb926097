"""Which Airflow the provider runs on, checked on import, before anything breaks late.

Import-light (metadata only, no ``airflow`` import): ``airflow_provider/__init__`` runs it while
Airflow discovers providers.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version

FLOOR = (3, 1)  # the operator, decorator, hook, trigger, warm-fork operators
TESTED = (3, 1), (3, 3)  # the oldest and newest minor the test legs run (README, "Engine versions")
EXECUTOR_MIN = (3, 3)  # the executor follows common.sandbox and pre-assigned try UUIDs (3.3)
SUPPORTED_TEXT = "apache-airflow>=3.1"  # the extra's requirement: a floor and no cap, as Airflow's providers
TESTED_TEXT = "Airflow 3.1 to 3.3"


class UntestedAirflowWarning(UserWarning):
    """This Airflow is newer than any the test legs run: it may work; the warning says what is tested."""


# Airflow 3.2 (3.2.2, the last 3.2) works only below these and does not declare them (3.3 declares the
# first): with today's newer ones its own Execution API fails before any provider code runs
# (fastapi 0.145+: building its routes; svcs 26.2: in-process requests, dag.test() included).
AIRFLOW_32_CAPS = {"fastapi": (0, 137), "svcs": (26, 2)}


def release(text: str) -> tuple[int, int]:
    """``"3.2.2"`` → ``(3, 2)``; a pre-release such as ``"3.4.0rc1"`` counts as its release."""
    parts = [p for p in text.split(".")[:2]]
    digits = ["".join(ch for ch in p if ch.isdigit()) or "0" for p in parts]
    return int(digits[0]), int(digits[1]) if len(digits) > 1 else 0


def airflow_release() -> tuple[int, int] | None:
    try:
        return release(version("apache-airflow"))
    except PackageNotFoundError:  # e.g. apache-airflow-core alone
        try:
            return release(version("apache-airflow-core"))
        except PackageNotFoundError:
            return None


def check_airflow(found: tuple[int, int] | None = None, installed: Mapping[str, str] | None = None) -> None:
    """Raise ImportError below the floor (the provider uses 3.1's task SDK); warn once above the
    newest tested minor (a newer Airflow should not be blocked, only told what is tested); warn when
    an Airflow 3.2 sits next to a dependency that breaks it (``installed``: ``{name: version}``,
    read from the environment when not given)."""
    found = airflow_release() if found is None else found
    if found is not None and found < FLOOR:
        raise ImportError(
            f"pandastack-workflows' Airflow provider needs {SUPPORTED_TEXT}; this is Airflow "
            f"{found[0]}.{found[1]}. Upgrade Airflow (see the README's version table)."
        )
    if found is not None and found > TESTED[1]:
        warnings.warn(
            f"pandastack-workflows' Airflow provider is tested on {TESTED_TEXT}; this is Airflow "
            f"{found[0]}.{found[1]}, newer than any tested. It is expected to work; report what does not.",
            UntestedAirflowWarning,
            stacklevel=2,
        )
    if found == (3, 2) and (too_new := airflow_32_breakers(installed)):
        warnings.warn(
            f"Airflow 3.2 needs fastapi<0.137 and svcs<26.2 (it does not declare them); this environment "
            f"has {', '.join(too_new)}, with which Airflow's own Execution API fails (route building, or "
            "\"'State' object has no attribute 'svcs_registry'\" in dag.test() and in-process runs). "
            "Fix: pip install 'fastapi<0.137' 'svcs<26.2' (the README's version table).",
            RuntimeWarning,
            stacklevel=2,
        )


def airflow_32_breakers(installed: Mapping[str, str] | None = None) -> list[str]:
    """``["svcs 26.2.0", ...]``: the installed dependencies at or above Airflow 3.2's caps."""
    out = []
    for name, cap in AIRFLOW_32_CAPS.items():
        if installed is not None:
            have = installed.get(name)
        else:
            try:
                have = version(name)
            except PackageNotFoundError:
                have = None
        if have is not None and release(have) >= cap:
            out.append(f"{name} {have}")
    return out


def check_executor(found: tuple[int, int] | None = None) -> None:
    """The executor alone needs Airflow 3.3: say so when it is loaded on 3.1 or 3.2."""
    found = airflow_release() if found is None else found
    if found is not None and found < EXECUTOR_MIN:
        raise ImportError(
            f"PandaStackExecutor needs apache-airflow>=3.3 (pre-assigned try UUIDs, the common.sandbox "
            f"contract); this is Airflow {found[0]}.{found[1]}. The operators, @task.pandastack, the hook "
            "and the trigger work on 3.1 and 3.2; use them, or upgrade Airflow for the executor."
        )
