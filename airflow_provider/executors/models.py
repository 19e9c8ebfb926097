"""Value objects of the sandbox executor contract: frozen, validated, JSON-safe.

Names and shapes follow Airflow's ``common.sandbox`` provider (``SandboxLaunchRequest``,
``SandboxHandle``, ``SandboxResult``, ``SandboxExecutionRef`` persisted in
``external_executor_id``) so the executor can sit on that engine the day it ships.
Every object checks itself at construction: a bad value fails before any sandbox
exists, with an error naming the field and the fix.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from uuid import UUID

from airflow_provider.exceptions import PandaStackAirflowError
from pandastack_jobs.spec import TEMPLATE_NAME

# executor_config={"pandastack": {...}}: the keys a task may set.
EXECUTOR_CONFIG_KEY = "pandastack"
TASK_OPTIONS = frozenset({"template", "timeout", "ttl", "env"})
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_REF_LENGTH = 4096  # the handle is a few ids; anything longer is not ours


class SandboxConfigurationError(ValueError):
    """A sandbox option is invalid. The message names the option and the fix."""


class SandboxInvalidHandleError(ValueError):
    """A persisted handle does not describe a sandbox of this request."""


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


def validate_env(env: object, name: str = "env") -> dict[str, str]:
    """A copy of ``env`` as str→str with valid names; ``AIRFLOW_*`` keys are refused.

    The executor sets the Airflow runtime variables itself (the Execution API URL, the
    DAG folder): a task must not redirect them.
    """
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise SandboxConfigurationError(f"{name}: must be a mapping of variable names to strings")
    out: dict[str, str] = {}
    for key, value in env.items():
        if not isinstance(key, str) or not _ENV_NAME.match(key) or not isinstance(value, str):
            raise SandboxConfigurationError(
                f"{name}[{key!r}]: names must match [A-Za-z_][A-Za-z0-9_]* and values must be strings"
            )
        out[key] = value
    if reserved := sorted(k for k in out if k.upper().startswith("AIRFLOW_")):
        raise SandboxConfigurationError(
            f"{name}: reserved Airflow variables cannot be set per task: {', '.join(reserved)}; "
            "the executor sets the Airflow runtime variables itself, rename yours"
        )
    return out


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
        if self.retry_after is not None and (
            isinstance(self.retry_after, bool)
            or not isinstance(self.retry_after, (int, float))
            or not math.isfinite(self.retry_after)
            or self.retry_after <= 0
        ):
            raise SandboxConfigurationError("retry_after: must be a positive number of seconds or None")

    @property
    def terminal(self) -> bool:
        return self.state in (SandboxState.SUCCEEDED, SandboxState.FAILED, SandboxState.GONE)


@dataclass(frozen=True)
class SandboxOutput:
    """The end of a workload's output, as the driver captured it (bounded, redacted)."""

    stdout: str = ""
    stderr: str = ""
    truncated: bool = False


def _json_object(value: object, name: str) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise SandboxConfigurationError(f"{name}: must be a string-keyed JSON object")
    try:
        copied = json.loads(json.dumps(dict(value), allow_nan=False, sort_keys=True))
    except (TypeError, ValueError) as exc:
        raise SandboxConfigurationError(f"{name}: must hold JSON values only ({exc})") from None
    return copied  # type: ignore[no-any-return]


@dataclass(frozen=True)
class SandboxHandle:
    """Opaque, JSON-safe identity of a launched workload, as the driver returned it."""

    data: Mapping[str, Any]
    display_name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "data", _json_object(self.data, "handle"))
        if self.display_name is not None and (
            not isinstance(self.display_name, str) or not self.display_name
        ):
            raise SandboxConfigurationError("display_name: must be a non-empty string or None")


@dataclass(frozen=True)
class SandboxLaunchConfig:
    """What one task try asks for: the executor's defaults overlaid with ``executor_config``."""

    template: str
    timeout_seconds: int
    ttl_seconds: int
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.template, str) or not TEMPLATE_NAME.match(self.template):
            raise SandboxConfigurationError(
                f"template: {self.template!r} is not a template name; use 1-64 of A-Z a-z 0-9 . _ -"
            )
        _positive_int(self.timeout_seconds, "timeout")
        _positive_int(self.ttl_seconds, "ttl")
        if self.ttl_seconds < self.timeout_seconds:
            raise SandboxConfigurationError(
                f"ttl: {self.ttl_seconds}s is shorter than the timeout ({self.timeout_seconds}s); "
                "leave ttl unset or make it at least the timeout"
            )
        object.__setattr__(self, "env", validate_env(self.env))

    def overlay(self, executor_config: object) -> SandboxLaunchConfig:
        """This config with a task's ``executor_config={"pandastack": {...}}`` applied."""
        options = task_options(executor_config)
        timeout = options.get("timeout", self.timeout_seconds)
        if "ttl" in options:
            ttl = options["ttl"]
        else:  # keep the configured margin over the timeout
            ttl = max(self.ttl_seconds, timeout + (self.ttl_seconds - self.timeout_seconds))
        return SandboxLaunchConfig(
            template=options.get("template", self.template),
            timeout_seconds=timeout,
            ttl_seconds=ttl,
            env={**self.env, **options.get("env", {})},
        )


def task_options(executor_config: object) -> dict[str, Any]:
    """Validate ``executor_config["pandastack"]``: template, timeout, ttl, env (nothing else)."""
    if executor_config is None:
        return {}
    if not isinstance(executor_config, Mapping):
        raise SandboxConfigurationError(
            "executor_config: must be a dict, e.g. {'pandastack': {'timeout': 600}}"
        )
    options = executor_config.get(EXECUTOR_CONFIG_KEY, {})
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise SandboxConfigurationError(f"executor_config[{EXECUTOR_CONFIG_KEY!r}]: must be a dict")
    if unknown := sorted(set(options) - TASK_OPTIONS):
        raise SandboxConfigurationError(
            f"executor_config[{EXECUTOR_CONFIG_KEY!r}]: unknown option(s) {', '.join(map(str, unknown))}; "
            f"use {', '.join(sorted(TASK_OPTIONS))}"
        )
    out = dict(options)
    for name in ("timeout", "ttl"):
        if name in out:
            _positive_int(out[name], f"executor_config[{EXECUTOR_CONFIG_KEY!r}][{name!r}]")
    if "env" in out:
        out["env"] = validate_env(out["env"], f"executor_config[{EXECUTOR_CONFIG_KEY!r}]['env']")
    return out


@dataclass(frozen=True)
class SandboxLaunchRequest:
    """One task try to launch: the Task SDK argv, its environment and the sandbox options."""

    request_id: str
    command: tuple[str, ...]
    env: Mapping[str, str]
    config: SandboxLaunchConfig
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not is_preassigned_executor_id(self.request_id):
            raise SandboxConfigurationError(
                f"request_id: {self.request_id!r} is not a UUID; the executor needs the id Airflow "
                "pre-assigns to each task try (Airflow >= 3.3)"
            )
        if not self.command or not all(isinstance(p, str) and p for p in self.command):
            raise SandboxConfigurationError("command: must be a non-empty argv of non-empty strings")
        object.__setattr__(self, "command", tuple(self.command))
        if not isinstance(self.env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()
        ):
            raise SandboxConfigurationError("env: must map names to strings")
        object.__setattr__(self, "env", dict(self.env))
        if not isinstance(self.config, SandboxLaunchConfig):
            raise SandboxConfigurationError("config: must be a SandboxLaunchConfig")
        object.__setattr__(self, "labels", {str(k): str(v) for k, v in self.labels.items()})


@dataclass(frozen=True)
class RecoveredSandbox:
    """A handle a driver rebuilt for a request whose handle was never persisted."""

    handle: SandboxHandle


@dataclass(frozen=True)
class SandboxExecutionRef:
    """What ``external_executor_id`` holds once a sandbox runs: driver, request UUID and handle."""

    driver: str
    request_id: str
    handle: SandboxHandle

    PREFIX = "sandbox:v1:"

    def __post_init__(self) -> None:
        if not isinstance(self.driver, str) or not self.driver:
            raise SandboxConfigurationError("driver: must be a non-empty string")
        if not is_preassigned_executor_id(self.request_id):
            raise SandboxConfigurationError("request_id: must be a canonical UUID")
        if not isinstance(self.handle, SandboxHandle):
            raise SandboxConfigurationError("handle: must be a SandboxHandle")

    def encode(self) -> str:
        payload = json.dumps(
            {
                "driver": self.driver,
                "request_id": self.request_id,
                "handle": dict(self.handle.data),
                "display_name": self.handle.display_name,
            },
            separators=(",", ":"),
            sort_keys=True,
        ).encode()
        encoded = self.PREFIX + base64.urlsafe_b64encode(payload).rstrip(b"=").decode()
        if len(encoded) > MAX_REF_LENGTH:
            raise SandboxConfigurationError("handle: too large to persist in external_executor_id")
        return encoded

    @classmethod
    def decode(cls, value: object, *, expected_driver: str | None = None) -> SandboxExecutionRef | None:
        """The ref in ``value``, or None when it is not one of ours (a bare UUID, another driver, junk)."""
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
            )
        except (binascii.Error, UnicodeDecodeError, ValueError, KeyError, TypeError):
            return None
