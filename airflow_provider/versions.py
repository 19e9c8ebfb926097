"""Which Airflow the provider runs on, checked on import, before anything breaks late.

Import-light (metadata only, no ``airflow`` import): ``airflow_provider/__init__`` runs it while
Airflow discovers providers.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

SUPPORTED = (3, 1), (3, 4)  # [low, high): the operator, decorator, hook, trigger, warm-fork operators
EXECUTOR_MIN = (3, 3)  # the executor follows common.sandbox and pre-assigned try UUIDs (3.3)
SUPPORTED_TEXT = "apache-airflow>=3.1,<3.4"


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


def check_airflow(found: tuple[int, int] | None = None) -> None:
    """Raise ImportError naming the supported range when this Airflow is outside it."""
    found = airflow_release() if found is None else found
    if found is not None and not SUPPORTED[0] <= found < SUPPORTED[1]:
        raise ImportError(
            f"pandastack-workflows' Airflow provider supports {SUPPORTED_TEXT}; this is Airflow "
            f"{found[0]}.{found[1]}. Install a supported Airflow (see the README's version table)."
        )


def check_executor(found: tuple[int, int] | None = None) -> None:
    """The executor alone needs Airflow 3.3: say so when it is loaded on 3.1 or 3.2."""
    found = airflow_release() if found is None else found
    if found is not None and found < EXECUTOR_MIN:
        raise ImportError(
            f"PandaStackExecutor needs apache-airflow>=3.3 (pre-assigned try UUIDs, the common.sandbox "
            f"contract); this is Airflow {found[0]}.{found[1]}. The operators, @task.pandastack, the hook "
            "and the trigger work on 3.1 and 3.2; use them, or upgrade Airflow for the executor."
        )
