"""The ``common.sandbox`` exceptions, below everything else of the contract: the models raise them
and the driver contract (:mod:`.contract`) names the models, so they are resolved here.

Whether the provider (``apache-airflow-providers-common-sandbox``) is used is decided once, here, for
the whole contract: all its names, or none (:func:`provider_modules`). Type checkers always see the
local copies (:mod:`._contract_errors_local`).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from . import _contract_errors_local as local

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


def provider_modules() -> dict[str, ModuleType] | None:
    """The provider's contract modules when every name of :data:`NAMES` is in them; None (the local
    copies) when it is not installed or a release lacks one: never half the provider's and half ours."""
    try:
        modules = {part: importlib.import_module(f"{PROVIDER}.{part}") for part in NAMES}
        for part, names in NAMES.items():
            for name in names:
                getattr(modules[part], name)
    except (ImportError, AttributeError):
        return None
    return modules


if TYPE_CHECKING:
    from ._contract_errors_local import (
        SandboxConfigurationError,
        SandboxError,
        SandboxInvalidHandleError,
        SandboxLaunchUnfencedError,
        SandboxProtocolError,
    )

    COMMON_SANDBOX: bool
else:
    _modules = provider_modules()
    COMMON_SANDBOX = _modules is not None
    _source = _modules["exceptions"] if _modules is not None else local
    globals().update({name: getattr(_source, name) for name in NAMES["exceptions"]})
    del _modules, _source

__all__ = [
    "COMMON_SANDBOX",
    "SandboxConfigurationError",
    "SandboxError",
    "SandboxInvalidHandleError",
    "SandboxLaunchUnfencedError",
    "SandboxProtocolError",
]
