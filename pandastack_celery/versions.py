"""Which Celery the tasks run on, checked on import (metadata only, before Celery is imported).

A floor and no cap (README, "Engine versions"): the adapter uses Celery's public task API only
(``Task.__call__``, ``Task.retry``, ``request``), which 5.4 and later keep.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

FLOOR = (5, 4)
SUPPORTED_TEXT = "celery>=5.4"


def release(text: str) -> tuple[int, int]:
    """``"5.7.0"`` → ``(5, 7)``; a pre-release counts as its release."""
    digits = ["".join(ch for ch in p if ch.isdigit()) or "0" for p in text.split(".")[:2]]
    return int(digits[0]), int(digits[1]) if len(digits) > 1 else 0


def check_celery(found: tuple[int, int] | None = None) -> None:
    """Raise ImportError naming the floor when this Celery is older (or missing)."""
    if found is None:
        try:
            found = release(version("celery"))
        except PackageNotFoundError:
            raise ImportError(
                "pandastack_celery needs Celery: pip install 'pandastack-workflows[celery]'"
            ) from None
    if found < FLOOR:
        raise ImportError(
            f"pandastack_celery supports {SUPPORTED_TEXT}; this is Celery {found[0]}.{found[1]}. "
            "Install a newer Celery (see the README's version table)."
        )
