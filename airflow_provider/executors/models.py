"""Value objects of the sandbox executor contract: frozen, validated, JSON-safe.

What follows Airflow's ``common.sandbox`` provider (its ``models.py``), field for field:
``SandboxState``, ``SandboxResult``, ``SandboxOutput``, ``SandboxHandle``,
``SandboxLaunchConfig`` and ``SandboxLaunchRequest`` (``provider_config``, ``env``,
``workdir``, ``timeout_seconds``, ``ttl_seconds``, ``keep``), ``RecoveredSandbox`` and
``SandboxExecutionRef`` (the ``sandbox:v1:`` reference in ``external_executor_id``, ``keep``
included), and ``is_preassigned_executor_id``. The exceptions are the provider's (:mod:`.contract`).

What is this executor's own: ``SandboxResult.terminal``; ``SandboxCapacityError`` (a capacity
refusal is requeued after ``Retry-After``, the provider has no such case); PandaStack's part of a
request lives in ``provider_config`` (``template`` and the try's ``labels``, see
:mod:`.launch`); ``keep`` is always False (a task cannot keep its sandbox here);
``SandboxExecutionRef`` is capped at 4 KiB (the provider allows 64 KiB; a PandaStack handle is a
few ids). Every object checks itself at construction: a bad value fails before any sandbox
exists, with an error naming the field.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from uuid import UUID

from airflow_provider.exceptions import PandaStackAirflowError

from .contract_errors import SandboxConfigurationError, SandboxInvalidHandleError

MAX_REF_LENGTH = 4096  # the handle is a few ids; anything longer is not ours

__all__ = [
    "RecoveredSandbox",
    "SandboxCapacityError",
    "SandboxConfigurationError",
    "SandboxExecutionRef",
    "SandboxHandle",
    "SandboxInvalidHandleError",
    "SandboxLaunchConfig",
    "SandboxLaunchRequest",
    "SandboxOutput",
    "SandboxResult",
    "SandboxState",
    "is_preassigned_executor_id",
]


class SandboxCapacityError(PandaStackAirflowError, RuntimeError):
    """The platform refused to create a sandbox for capacity; try again after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def is_preassigned_executor_id(value: object) -> bool:
    """True for a canonical UUID string: what Airflow pre-assigns to each task try."""
    if not isinstance(value, str) or not value:
        return False
    try:
        return str(UUID(value)) == value
    except ValueError:
        return False


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SandboxConfigurationError(f"{name}: {value!r} is not a positive whole number of seconds")
    return value


def _json_object(value: object, name: str) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise SandboxConfigurationError(f"{name}: must be a string-keyed JSON object")
    try:
        copied = json.loads(json.dumps(dict(value), allow_nan=False, sort_keys=True))
    except (TypeError, ValueError, RecursionError) as exc:
        raise SandboxConfigurationError(f"{name}: must hold JSON values only ({exc})") from None
    return copied  # type: ignore[no-any-return]


def _str_map(value: object, name: str) -> dict[str, str]:
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise SandboxConfigurationError(f"{name}: must map names to strings")
    return dict(value)


def _check_run(config: Any) -> None:
    """The fields ``SandboxLaunchConfig`` and ``SandboxLaunchRequest`` share, checked as the provider does."""
    if config.workdir is not None and (not isinstance(config.workdir, str) or not config.workdir.strip()):
        raise SandboxConfigurationError("workdir: must be a non-empty string or None")
    _positive_int(config.timeout_seconds, "timeout_seconds")
    _positive_int(config.ttl_seconds, "ttl_seconds")
    if config.ttl_seconds < config.timeout_seconds:
        raise SandboxConfigurationError(
            f"ttl_seconds: {config.ttl_seconds}s is shorter than the timeout ({config.timeout_seconds}s)"
        )
    if not isinstance(config.keep, bool):
        raise SandboxConfigurationError("keep: must be a bool")
    object.__setattr__(config, "provider_config", _json_object(config.provider_config, "provider_config"))


class SandboxState(str, Enum):
    """Provider-neutral state of one sandbox workload."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    GONE = "gone"


@dataclass(frozen=True)
class SandboxResult:
    """One observation of a launched workload."""

    state: SandboxState
    exit_code: int | None = None
    message: str | None = None
    retry_after: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.state, SandboxState):
            raise SandboxConfigurationError("state: must be a SandboxState")
        if self.exit_code is not None and (
            isinstance(self.exit_code, bool) or not isinstance(self.exit_code, int)
        ):
            raise SandboxConfigurationError("exit_code: must be an int or None")
        if self.message is not None and not isinstance(self.message, str):
            raise SandboxConfigurationError("message: must be a string or None")
        if self.retry_after is not None and (
            isinstance(self.retry_after, bool)
            or not isinstance(self.retry_after, (int, float))
            or not math.isfinite(self.retry_after)
            or self.retry_after <= 0
        ):
            raise SandboxConfigurationError("retry_after: must be a positive number of seconds or None")

    @property
    def terminal(self) -> bool:
        """The workload ended (this executor's shorthand; the provider spells the states out)."""
        return self.state in (SandboxState.SUCCEEDED, SandboxState.FAILED, SandboxState.GONE)


@dataclass(frozen=True)
class SandboxOutput:
    """The end of a workload's output, as the driver captured it (bounded, redacted)."""

    stdout: str = ""
    stderr: str = ""
    truncated: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.stdout, str) or not isinstance(self.stderr, str):
            raise SandboxConfigurationError("stdout, stderr: must be strings")
        if not isinstance(self.truncated, bool):
            raise SandboxConfigurationError("truncated: must be a bool")


@dataclass(frozen=True)
class SandboxHandle:
    """Opaque, JSON-safe identity of a launched workload, as the driver returned it."""

    data: Mapping[str, Any]
    display_name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "data", _json_object(self.data, "handle"))
        if self.display_name is not None and (
            not isinstance(self.display_name, str) or not self.display_name.strip()
        ):
            raise SandboxConfigurationError("display_name: must be a non-empty string or None")


@dataclass(frozen=True)
class SandboxLaunchConfig:
    """What the concrete executor prepared for one task try (``build_launch_config``'s result)."""

    provider_config: Mapping[str, Any]
    env: Mapping[str, str] = field(default_factory=dict)
    workdir: str | None = None
    timeout_seconds: int = 3600
    ttl_seconds: int = 86400
    keep: bool = False

    def __post_init__(self) -> None:
        env = _str_map(self.env, "env")
        if reserved := sorted(k for k in env if k.upper().startswith("AIRFLOW_")):
            raise SandboxConfigurationError(
                f"env: reserved Airflow variables cannot be set per task: {', '.join(reserved)}; "
                "the executor sets the Airflow runtime variables itself, rename yours"
            )
        object.__setattr__(self, "env", env)
        _check_run(self)


@dataclass(frozen=True)
class SandboxLaunchRequest:
    """One task try to launch: the Task SDK argv, its environment and the sandbox options."""

    request_id: str
    command: tuple[str, ...]
    env: Mapping[str, str]
    provider_config: Mapping[str, Any]
    workdir: str | None
    timeout_seconds: int
    ttl_seconds: int
    keep: bool = False

    def __post_init__(self) -> None:
        if not is_preassigned_executor_id(self.request_id):
            raise SandboxConfigurationError(
                f"request_id: {self.request_id!r} is not a UUID; the executor needs the id Airflow "
                "pre-assigns to each task try (Airflow >= 3.3)"
            )
        if not self.command or not all(isinstance(p, str) and p for p in self.command):
            raise SandboxConfigurationError("command: must be a non-empty argv of non-empty strings")
        object.__setattr__(self, "command", tuple(self.command))
        object.__setattr__(self, "env", _str_map(self.env, "env"))
        _check_run(self)


@dataclass(frozen=True)
class RecoveredSandbox:
    """A handle a driver rebuilt for a request whose handle was never persisted."""

    handle: SandboxHandle
    keep: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.handle, SandboxHandle):
            raise SandboxConfigurationError("handle: must be a SandboxHandle")
        if not isinstance(self.keep, bool):
            raise SandboxConfigurationError("keep: must be a bool")


@dataclass(frozen=True)
class SandboxExecutionRef:
    """What ``external_executor_id`` holds once a sandbox runs: driver, request UUID and handle."""

    driver: str
    request_id: str
    handle: SandboxHandle
    keep: bool = False

    PREFIX = "sandbox:v1:"

    def __post_init__(self) -> None:
        if not isinstance(self.driver, str) or not self.driver:
            raise SandboxConfigurationError("driver: must be a non-empty string")
        if not is_preassigned_executor_id(self.request_id):
            raise SandboxConfigurationError("request_id: must be a canonical UUID")
        if not isinstance(self.handle, SandboxHandle):
            raise SandboxConfigurationError("handle: must be a SandboxHandle")
        if not isinstance(self.keep, bool):
            raise SandboxConfigurationError("keep: must be a bool")

    def encode(self) -> str:
        payload = json.dumps(
            {
                "display_name": self.handle.display_name,
                "driver": self.driver,
                "handle": dict(self.handle.data),
                "keep": self.keep,
                "request_id": self.request_id,
            },
            allow_nan=False,
            separators=(",", ":"),
            sort_keys=True,
        ).encode()
        encoded = self.PREFIX + base64.urlsafe_b64encode(payload).rstrip(b"=").decode()
        if len(encoded) > MAX_REF_LENGTH:
            raise SandboxConfigurationError("handle: too large to persist in external_executor_id")
        return encoded

    @classmethod
    def decode(cls, value: object, *, expected_driver: str | None = None) -> SandboxExecutionRef | None:
        """The ref in ``value``, or None when it is not one of ours (a bare UUID, another driver, junk).

        A ref persisted before ``keep`` was written (no ``keep`` key) reads as ``keep=False``.
        """
        if not isinstance(value, str) or len(value) > MAX_REF_LENGTH or not value.startswith(cls.PREFIX):
            return None
        token = value[len(cls.PREFIX) :]
        token += "=" * (-len(token) % 4)
        try:
            payload = json.loads(base64.urlsafe_b64decode(token).decode())
            if expected_driver is not None and payload["driver"] != expected_driver:
                return None
            return cls(
                driver=payload["driver"],
                request_id=payload["request_id"],
                handle=SandboxHandle(payload["handle"], payload.get("display_name")),
                keep=payload.get("keep", False),
            )
        except (binascii.Error, UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError):
            return None
