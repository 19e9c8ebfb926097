"""Integration settings, read from ``PREFECT_INTEGRATIONS_PANDASTACK_*`` environment variables.

Read at call time (not import time), so a worker's environment applies to the
runs it executes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

PREFIX = "PREFECT_INTEGRATIONS_PANDASTACK_"


def _float(name: str, default: float) -> float:
    raw = os.environ.get(PREFIX + name)
    if raw is None or not raw.strip():
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{PREFIX + name}={raw!r} is not a number") from None


def _int(name: str, default: int) -> int:
    return int(_float(name, default))


@dataclass(frozen=True)
class PandaStackSettings:
    """Knobs of the Prefect integration (all optional)."""

    retry_base_seconds: float = 2.0
    """First redelivery delay; doubles per retry (``..._RETRY_BASE_SECONDS``)."""
    retry_max_seconds: float = 300.0
    """Cap on one redelivery delay (``..._RETRY_MAX_SECONDS``)."""
    files_dir: Optional[str] = None
    """Where collected files are stored for link artifacts (``..._FILES_DIR``); default: Prefect's
    local result storage directory."""
    table_max_rows: int = 500
    """Rows beyond this are left out of a table artifact (``..._TABLE_MAX_ROWS``)."""
    markdown_max_chars: int = 200_000
    """A markdown artifact is cut at this many characters (``..._MARKDOWN_MAX_CHARS``)."""

    @classmethod
    def from_env(cls) -> PandaStackSettings:
        return cls(
            retry_base_seconds=_float("RETRY_BASE_SECONDS", cls.retry_base_seconds),
            retry_max_seconds=_float("RETRY_MAX_SECONDS", cls.retry_max_seconds),
            files_dir=os.environ.get(PREFIX + "FILES_DIR") or None,
            table_max_rows=_int("TABLE_MAX_ROWS", cls.table_max_rows),
            markdown_max_chars=_int("MARKDOWN_MAX_CHARS", cls.markdown_max_chars),
        )


def get_settings() -> PandaStackSettings:
    return PandaStackSettings.from_env()
