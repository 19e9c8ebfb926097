"""``pandastack-local serve`` without the ``[local]`` extra says what to install (no traceback).

The extra's packages are installed in the test venvs, so their absence is made by blocking the
import (``sys.modules[name] = None``) in a fresh interpreter that runs the real CLI.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

SERVE_WITHOUT = (
    "import sys; sys.modules[{name!r}] = None; from pandastack_local.cli import main; main(['serve'])"
)


@pytest.mark.parametrize("missing", ["uvicorn", "fastapi"])
def test_serve_without_the_extra_names_the_extra(missing: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SERVE_WITHOUT.format(name=missing)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert missing in proc.stderr
    # The install line that works: from a clone or the wheel (the distribution is not on the index).
    assert "pip install '.[local]'" in proc.stderr and "not on the package index" in proc.stderr
    assert "Traceback" not in proc.stderr
