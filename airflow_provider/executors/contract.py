"""What Airflow's ``common.sandbox`` provider defines and this executor uses unchanged: the
``SandboxDriver`` contract and its exceptions.

When the provider (``apache-airflow-providers-common-sandbox``) is installed they are imported
from it, so a driver written against the provider and this executor share one class and one
set of exceptions; otherwise the copies in :mod:`._contract_local` stand in (same names, same
methods, same exception tree). ``COMMON_SANDBOX`` says which one is in use.
Type checkers always see the local copies.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

PROVIDER = "airflow.providers.common.sandbox"
NAMES = {
    "driver": ("SandboxDriver", "SandboxDriverFactory"),
    "exceptions": (
        "SandboxError",
        "SandboxConfigurationError",
        "SandboxProtocolError",
        "SandboxInvalidHandleError",
        "SandboxLaunchUnfencedError",
    ),
}


def resolve() -> tuple[dict[str, Any], bool]:
    """The contract's names, from the provider when it is importable (True) or the local copies."""
    modules: dict[str, ModuleType] = {}
    try:
        for part in NAMES:
            modules[part] = importlib.import_module(f"{PROVIDER}.{part}")
        found = {name: getattr(modules[part], name) for part, names in NAMES.items() for name in names}
    except (ImportError, AttributeError):  # not installed, or a release without one of the names
        from . import _contract_local as local

        return {name: getattr(local, name) for names in NAMES.values() for name in names}, False
    return found, True


if TYPE_CHECKING:
    from ._contract_local import (
        SandboxConfigurationError,
        SandboxDriver,
        SandboxDriverFactory,
        SandboxError,
        SandboxInvalidHandleError,
        SandboxLaunchUnfencedError,
        SandboxProtocolError,
    )

    COMMON_SANDBOX: bool
else:
    _names, COMMON_SANDBOX = resolve()
    globals().update(_names)
    del _names

__all__ = [
    "COMMON_SANDBOX",
    "SandboxConfigurationError",
    "SandboxDriver",
    "SandboxDriverFactory",
    "SandboxError",
    "SandboxInvalidHandleError",
    "SandboxLaunchUnfencedError",
    "SandboxProtocolError",
]
