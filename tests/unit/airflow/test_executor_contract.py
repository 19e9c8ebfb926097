"""The driver contract comes from ``common.sandbox`` when that provider is installed, else the
local copy: both branches of :func:`airflow_provider.executors.contract.resolve`."""

from __future__ import annotations

import sys
import types
from abc import ABC

import pytest

from airflow_provider.executors import _contract_local, contract
from airflow_provider.executors.driver import PandaStackDriver
from airflow_provider.executors.testing import FakeSandboxDriver


def test_without_the_provider_the_local_copy_is_the_contract() -> None:
    names, from_provider = contract.resolve()
    assert from_provider is False and contract.COMMON_SANDBOX is False
    assert names["SandboxDriver"] is _contract_local.SandboxDriver is contract.SandboxDriver
    assert issubclass(PandaStackDriver, contract.SandboxDriver)
    assert issubclass(FakeSandboxDriver, contract.SandboxDriver)


def test_with_the_provider_installed_its_classes_are_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in for ``airflow.providers.common.sandbox`` (not installable here) in sys.modules."""
    driver_mod = types.ModuleType(f"{contract.PROVIDER}.driver")
    exc_mod = types.ModuleType(f"{contract.PROVIDER}.exceptions")

    class SandboxDriver(ABC):  # noqa: B024 - a stand-in
        pass

    driver_mod.SandboxDriver = SandboxDriver  # type: ignore[attr-defined]
    driver_mod.SandboxDriverFactory = object  # type: ignore[attr-defined]
    for name in contract.NAMES["exceptions"]:
        setattr(exc_mod, name, type(name, (Exception,), {}))
    monkeypatch.setitem(sys.modules, contract.PROVIDER, types.ModuleType(contract.PROVIDER))
    monkeypatch.setitem(sys.modules, driver_mod.__name__, driver_mod)
    monkeypatch.setitem(sys.modules, exc_mod.__name__, exc_mod)
    names, from_provider = contract.resolve()
    assert from_provider is True
    assert names["SandboxDriver"] is SandboxDriver
    assert names["SandboxLaunchUnfencedError"] is exc_mod.SandboxLaunchUnfencedError


def test_a_provider_release_missing_a_name_falls_back_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Never half the provider's classes and half ours."""
    driver_mod = types.ModuleType(f"{contract.PROVIDER}.driver")
    driver_mod.SandboxDriver = type("SandboxDriver", (), {})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, contract.PROVIDER, types.ModuleType(contract.PROVIDER))
    monkeypatch.setitem(sys.modules, driver_mod.__name__, driver_mod)
    names, from_provider = contract.resolve()
    assert from_provider is False and names["SandboxDriver"] is _contract_local.SandboxDriver


def test_the_local_exceptions_have_the_providers_tree() -> None:
    c = contract
    assert issubclass(c.SandboxConfigurationError, c.SandboxError)
    assert issubclass(c.SandboxConfigurationError, ValueError)
    assert issubclass(c.SandboxInvalidHandleError, c.SandboxProtocolError)
    error = c.SandboxLaunchUnfencedError("rid", TimeoutError("lost"), OSError("fence failed"))
    assert isinstance(error, c.SandboxError) and "could not be fenced: fence failed" in str(error)
    assert isinstance(error.launch_error, TimeoutError) and error.request_id == "rid"
