"""Which Prefect the blocks run on, checked on import (metadata only, before Prefect is imported).

Prefect 3.6 to 3.9: the blocks, tasks, ``@sandbox_task`` and the ``pandastack`` worker, retries
included (3.6-3.8 call only a plain-function retry condition: retries.py).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

SUPPORTED = (3, 6), (3, 10)
SUPPORTED_TEXT = "prefect>=3.6,<3.10"


def release(text: str) -> tuple[int, int]:
    digits = ["".join(ch for ch in p if ch.isdigit()) or "0" for p in text.split(".")[:2]]
    return int(digits[0]), int(digits[1]) if len(digits) > 1 else 0


def check_prefect(found: tuple[int, int] | None = None) -> None:
    """Raise ImportError naming the supported range when this Prefect is outside it."""
    if found is None:
        try:
            found = release(version("prefect"))
        except PackageNotFoundError:
            return
    if not SUPPORTED[0] <= found < SUPPORTED[1]:
        raise ImportError(
            f"pandastack-workflows' Prefect blocks support {SUPPORTED_TEXT}; this is Prefect "
            f"{found[0]}.{found[1]}. Install a supported Prefect (see the README's version table)."
        )
