"""Which Prefect the blocks run on, checked on import (metadata only, before Prefect is imported).

Prefect 3.6 and newer (tested: 3.6 to 3.9): the blocks, tasks, ``@sandbox_task`` and the
``pandastack`` worker, retries included (3.6-3.8 call only a plain-function retry condition:
retries.py).
"""

from __future__ import annotations

import warnings
from importlib.metadata import PackageNotFoundError, version

FLOOR = (3, 6)
TESTED = (3, 6), (3, 9)  # the oldest and newest minor the test legs run (README, "Engine versions")
SUPPORTED_TEXT = "prefect>=3.6"  # the extra's requirement: a floor and no cap
TESTED_TEXT = "Prefect 3.6 to 3.9"


class UntestedPrefectWarning(UserWarning):
    """This Prefect is newer than any the test legs run: it may work; the warning says what is tested."""


def release(text: str) -> tuple[int, int]:
    digits = ["".join(ch for ch in p if ch.isdigit()) or "0" for p in text.split(".")[:2]]
    return int(digits[0]), int(digits[1]) if len(digits) > 1 else 0


def check_prefect(found: tuple[int, int] | None = None) -> None:
    """Raise ImportError below the floor; warn once above the newest tested minor (a newer Prefect
    should not be blocked, only told what is tested)."""
    if found is None:
        try:
            found = release(version("prefect"))
        except PackageNotFoundError:
            return
    if found < FLOOR:
        raise ImportError(
            f"pandastack-workflows' Prefect blocks need {SUPPORTED_TEXT}; this is Prefect "
            f"{found[0]}.{found[1]}. Upgrade Prefect (see the README's version table)."
        )
    if found > TESTED[1]:
        warnings.warn(
            f"pandastack-workflows' Prefect blocks are tested on {TESTED_TEXT}; this is Prefect "
            f"{found[0]}.{found[1]}, newer than any tested. They are expected to work; report what does not.",
            UntestedPrefectWarning,
            stacklevel=2,
        )
