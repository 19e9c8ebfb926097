"""The PandaStack-specific launch configuration: ``[pandastack_executor]`` defaults and a task's
``executor_config={"pandastack": {...}}``, validated by the core's job declaration.

``template``, ``timeout``, ``ttl`` and ``env`` are options of the core's :class:`~pandastack_jobs.JobSpec`:
values given as text (airflow.cfg) are read by that declaration's coercion
(:func:`pandastack_jobs.coerce_options`) and checked by ``JobSpec`` itself, so a bad value is
refused with the core's message, and the TTL follows the core's one rule
(:attr:`JobSpec.ttl_seconds <pandastack_jobs.JobSpec.ttl_seconds>`: explicit, else the timeout
plus ``TTL_MARGIN_SECONDS``). What the executor adds: whole seconds (``common.sandbox``'s
``timeout_seconds`` is an int) and no ``AIRFLOW_*`` names in ``env``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pandastack_jobs import JobSpec, JobSpecError, coerce_options

from .models import SandboxConfigurationError, SandboxLaunchConfig

EXECUTOR_CONFIG_KEY = "pandastack"
# The core's options a task may set through executor_config (a subset of JobSpec's).
TASK_OPTIONS = ("template", "timeout", "ttl", "env")
DEFAULT_TEMPLATE = "code-interpreter"
DEFAULT_TIMEOUT = 3600


def _core_spec(where: str, values: Mapping[str, Any]) -> JobSpec:
    """``values`` read and checked by the core's declaration; errors name ``where`` and the option."""
    try:
        return JobSpec(command=":", **coerce_options(values))
    except JobSpecError as exc:
        raise SandboxConfigurationError(f"{where}: {exc}") from None


def _whole_seconds(value: float, where: str) -> int:
    if isinstance(value, float) and not value.is_integer():
        raise SandboxConfigurationError(
            f"{where}: timeout: {value!r} is not a whole number of seconds; give e.g. {math.ceil(value)}"
        )
    return int(value)


@dataclass(frozen=True)
class PandaStackLaunchConfig:
    """One try's PandaStack options: the section's defaults, a task's ``executor_config`` over them.

    ``ttl`` None means "the core's rule"; ``ttl_seconds`` is what the sandbox gets.
    """

    template: str = DEFAULT_TEMPLATE
    timeout_seconds: int = DEFAULT_TIMEOUT
    ttl: int | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    where: str = field(default="[pandastack_executor]", compare=False, repr=False)

    def __post_init__(self) -> None:
        spec = self._spec()
        object.__setattr__(self, "timeout_seconds", _whole_seconds(spec.timeout, self.where))
        object.__setattr__(self, "env", dict(spec.env))
        if reserved := sorted(k for k in spec.env if k.upper().startswith("AIRFLOW_")):
            raise SandboxConfigurationError(
                f"{self.where}: env: reserved Airflow variables cannot be set per task: "
                f"{', '.join(reserved)}; the executor sets the Airflow runtime variables itself, rename yours"
            )

    def _spec(self) -> JobSpec:
        return _core_spec(
            self.where,
            {"template": self.template, "timeout": self.timeout_seconds, "ttl": self.ttl, "env": self.env},
        )

    @property
    def ttl_seconds(self) -> int:
        """The sandbox's idle backstop, by the core's one rule (``JobSpec.ttl_seconds``)."""
        return self._spec().ttl_seconds

    @classmethod
    def from_section(cls, get: Any, section: str) -> PandaStackLaunchConfig:
        """The defaults from ``[section]`` (``get`` is ``conf.get``); the text is read by the core."""
        where = f"[{section}]"
        text = {name: get(section, name, fallback=None) for name in TASK_OPTIONS}
        try:
            values = coerce_options({name: value for name, value in text.items() if value})
        except JobSpecError as exc:
            raise SandboxConfigurationError(f"{where}: {exc}") from None
        if "timeout" in values:
            values["timeout_seconds"] = values.pop("timeout")
        return cls(**values, where=where)

    def overlay(self, executor_config: object) -> PandaStackLaunchConfig:
        """This config with a task's ``executor_config={"pandastack": {...}}`` applied.

        A task that sets ``timeout`` without ``ttl`` keeps the section's ``ttl`` only while it
        still covers the new timeout; otherwise the core's rule derives it.
        """
        options = task_options(executor_config)
        if not options:
            return self
        timeout = options.get("timeout", self.timeout_seconds)
        inherited = self.ttl if self.ttl is not None and self.ttl >= timeout else None
        return PandaStackLaunchConfig(
            template=options.get("template", self.template),
            timeout_seconds=timeout,
            ttl=options.get("ttl", inherited),
            env={**self.env, **options.get("env", {})},
            where=f"executor_config[{EXECUTOR_CONFIG_KEY!r}]",
        )

    def sandbox_config(self, labels: Mapping[str, str]) -> SandboxLaunchConfig:
        """The provider-neutral launch config: PandaStack's template and the try's labels in
        ``provider_config`` (the driver reads them back), the rest in ``common.sandbox``'s fields."""
        return SandboxLaunchConfig(
            provider_config={"template": self.template, "labels": dict(labels)},
            env=dict(self.env),
            timeout_seconds=self.timeout_seconds,
            ttl_seconds=self.ttl_seconds,
        )


def task_options(executor_config: object) -> dict[str, Any]:
    """``executor_config["pandastack"]``, read by the core's declaration: template, timeout, ttl, env."""
    where = f"executor_config[{EXECUTOR_CONFIG_KEY!r}]"
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
        raise SandboxConfigurationError(f"{where}: must be a dict")
    if unknown := sorted(set(map(str, options)) - set(TASK_OPTIONS)):
        raise SandboxConfigurationError(
            f"{where}: unknown option(s) {', '.join(unknown)}; use {', '.join(sorted(TASK_OPTIONS))}"
        )
    try:
        out = coerce_options(options)
    except JobSpecError as exc:
        raise SandboxConfigurationError(f"{where}: {exc}") from None
    if "timeout" in out:
        spec = _core_spec(where, {"timeout": out["timeout"]})
        out["timeout"] = _whole_seconds(spec.timeout, where)
    return out
