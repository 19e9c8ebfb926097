"""What Airflow's ``common.sandbox`` provider defines and this executor uses unchanged: the
``SandboxDriver`` contract and its exceptions.

When the provider (``apache-airflow-providers-common-sandbox``) is installed they are imported
from it, so a driver written against the provider and this executor share one class and one
set of exceptions; otherwise the copies in :mod:`._contract_local` stand in (same names, same
methods, same exception tree). ``COMMON_SANDBOX`` says which one is in use; the choice and the
exceptions are :mod:`.contract_errors`' (below the models, which raise them).
Type checkers always see the local copies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .contract_errors import (
    COMMON_SANDBOX,
    NAMES,
    PROVIDER,
    SandboxConfigurationError,
    SandboxError,
    SandboxInvalidHandleError,
    SandboxLaunchUnfencedError,
    SandboxProtocolError,
    provider_modules,
)


def resolve() -> tuple[dict[str, Any], bool]:
    """The contract's names, from the provider when it is importable (True) or the local copies."""
    modules = provider_modules()
    from_provider = modules is not None
    if modules is None:
        from . import _contract_errors_local, _contract_local

        modules = {"driver": _contract_local, "exceptions": _contract_errors_local}
    names = {name: getattr(modules[part], name) for part, parts in NAMES.items() for name in parts}
    return names, from_provider


if TYPE_CHECKING:
    from ._contract_local import SandboxDriver, SandboxDriverFactory
else:
    _names, _ = resolve()
    SandboxDriver, SandboxDriverFactory = _names["SandboxDriver"], _names["SandboxDriverFactory"]
    del _names, _

__all__ = [
    "COMMON_SANDBOX",
    "PROVIDER",
    "SandboxConfigurationError",
    "SandboxDriver",
    "SandboxDriverFactory",
    "SandboxError",
    "SandboxInvalidHandleError",
    "SandboxLaunchUnfencedError",
    "SandboxProtocolError",
]
