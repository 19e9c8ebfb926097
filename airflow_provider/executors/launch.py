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
from .options import TASK_OPTIONS as OPTION_NAMES

EXECUTOR_CONFIG_KEY = "pandastack"
# common.sandbox's provider-neutral key, and its options this executor reads (by their names here).
PORTABLE_CONFIG_KEY = "sandbox"
PORTABLE_OPTIONS = {"timeout_seconds": "timeout", "ttl_seconds": "ttl", "env": "env"}
# The core's options a task may set through executor_config (a subset of JobSpec's).
TASK_OPTIONS = OPTION_NAMES  # declared in options.py, with the section's other options
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
    """A task's options, read by the core's declaration: ``executor_config["pandastack"]`` (template,
    timeout, ttl, env) over the portable ``executor_config["sandbox"]`` (``common.sandbox``'s key:
    timeout_seconds, ttl_seconds, env; ``keep`` only false, ``workdir`` only unset), so a DAG written
    for any sandbox executor runs here. Where both set an option, ``pandastack`` wins."""
    if executor_config is None:
        return {}
    if not isinstance(executor_config, Mapping):
        raise SandboxConfigurationError(
            "executor_config: must be a dict, e.g. {'pandastack': {'timeout': 600}}"
        )
    out = _portable_options(executor_config.get(PORTABLE_CONFIG_KEY))
    where = f"executor_config[{EXECUTOR_CONFIG_KEY!r}]"
    options = _mapping(executor_config.get(EXECUTOR_CONFIG_KEY), where)
    if unknown := sorted(set(map(str, options)) - set(TASK_OPTIONS)):
        raise SandboxConfigurationError(
            f"{where}: unknown option(s) {', '.join(unknown)}; use {', '.join(sorted(TASK_OPTIONS))}"
        )
    env = {**out.get("env", {}), **_coerce(options, where).get("env", {})}
    out = {**out, **_coerce(options, where)}
    if env:
        out["env"] = env
    return out


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SandboxConfigurationError(f"{where}: must be a dict")
    return value


def _coerce(options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``options`` read by the core's declaration; a timeout in whole seconds."""
    try:
        out = coerce_options(options)
    except JobSpecError as exc:
        raise SandboxConfigurationError(f"{where}: {exc}") from None
    if "timeout" in out:
        spec = _core_spec(where, {"timeout": out["timeout"]})
        out["timeout"] = _whole_seconds(spec.timeout, where)
    return out


def _portable_options(value: object) -> dict[str, Any]:
    """``executor_config["sandbox"]`` in this executor's option names."""
    where = f"executor_config[{PORTABLE_CONFIG_KEY!r}]"
    options = _mapping(value, where)
    known = (*PORTABLE_OPTIONS, "keep", "workdir")
    if unknown := sorted(set(map(str, options)) - set(known)):
        raise SandboxConfigurationError(
            f"{where}: unknown option(s) {', '.join(unknown)}; use {', '.join(sorted(known))}"
        )
    if options.get("keep", False) is not False:
        raise SandboxConfigurationError(
            f"{where}: keep: PandaStackExecutor deletes every try's sandbox; leave keep out (or false)"
        )
    if options.get("workdir") is not None:
        raise SandboxConfigurationError(
            f"{where}: workdir: PandaStackExecutor runs each try in the template's work directory; "
            "leave workdir out (or set it in the template)"
        )
    return _coerce({PORTABLE_OPTIONS[k]: v for k, v in options.items() if k in PORTABLE_OPTIONS}, where)
