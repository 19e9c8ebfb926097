"""The install line a missing-extra error names: the distribution is not on the package index
(README), so ``pip install 'pandastack-workflows[queue]'`` would fail; a clone or the wheel works."""

from __future__ import annotations

WHEEL = "dist/pandastack_workflows-0.1.0-py3-none-any.whl"  # what `make wheel` builds


def install_line(*extras: str) -> str:
    """``pip install '.[queue,local]'`` in a clone, or the wheel ``make wheel`` builds, with ``extras``."""
    names = ",".join(extras)
    return (
        f"in a clone of the repository, pip install '.[{names}]' (or, from the wheel `make wheel` "
        f"builds, pip install '{WHEEL}[{names}]'); the distribution is not on the package index"
    )
