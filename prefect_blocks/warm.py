"""Warm starts for the ``pandastack`` worker: standbys with the Prefect engine already imported.

A cold flow run starts ``prefect flow-run execute`` in a fresh sandbox, and Prefect 3.9's
command is three interpreters in turn (the CLI, the workspace supervisor, the engine), each
importing Prefect. With ``warm_pool_size`` > 0 the worker keeps that many *standbys* per warm key
(``pandastack_jobs.StandbyPool``): fresh sandboxes whose runner has imported the engine's modules
(Prefect's only, never the flow's) and waits in ``accept()``. A flow run takes one, runs
``python3 -m prefect.engine`` (the engine's module form: it reads ``PREFECT__FLOW_RUN_ID``, runs
the deployment's pull steps and the flow) in a fork of that runner, and the sandbox is deleted
with the run, as a cold one is; no other run ever touches it.

Prefect reads its settings once, at import, so a standby fits a flow run only when every
``PREFECT_*`` setting it carries (the API URL, a configured logging level...) and every
``PYTHON*`` variable equals the ones the standby imported under: those form the key. The per-run
variables (``PREFECT__FLOW_RUN_ID`` and the other ``PREFECT__*``) and the configured non-Prefect
env are read at run time and are not part of it. The flow run's env file is still written and
sourced by the shell, so the attach hands the runner exactly the cold environment.

The secret settings (``PREFECT_API_KEY``, ``PREFECT_API_AUTH_STRING``) are never put on a command
line (the sandbox's log keeps commands): they go in a file the first preloaded module reads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

import pandastack

from pandastack_jobs import ConnectionConfig, Redactor, Standby, StandbyPool, WarmStart

if TYPE_CHECKING:
    from .credentials import PandaStackCredentials

logger = logging.getLogger(__name__)


class WarmConfiguration(Protocol):
    """What warm starts read of a flow run's prepared configuration (worker.py's
    ``PandaStackJobConfiguration``, which builds on this module)."""

    @property
    def command(self) -> str | None: ...
    @property
    def template(self) -> str: ...
    @property
    def warm_pool_size(self) -> int: ...
    def sandbox_env(self) -> dict[str, str]: ...
    def resolved_credentials(self) -> PandaStackCredentials: ...
    def redactor(self) -> Redactor: ...


# The cold command this pool type runs by default; only it has a warm form.
DEFAULT_COMMAND = "prefect flow-run execute"
# The engine's module form of it: Prefect's own ``if __name__ == "__main__"`` runner.
WARM_ARGV = ("python3", "-m", "prefect.engine")
# What prefect.engine's main imports before it runs a flow (not the flow's code). runpy then
# runs prefect.engine afresh as __main__ (flow_engine has imported it as a module too, so runpy
# prints a harmless RuntimeWarning saying so).
ENGINE_MODULES = (
    "prefect._internal.control_listener",
    "prefect.logging.loggers",
    "prefect.flow_engine",
    "prefect._internal.metrics",
    "prefect.deployments.steps.core",
    "prefect.deployments.steps.pull",
)
SECRET_SETTINGS = ("PREFECT_API_KEY", "PREFECT_API_AUTH_STRING")
SETTINGS_MODULE = "pandastack_prefect_settings"
SETTINGS_FILE = "/work/.warm/prefect-settings.json"
# Stdlib only; runs first in the runner (its sys.path[0] is /work/.warm), before Prefect is imported.
SETTINGS_LOADER = f'''"""The pool's secret Prefect settings, in the environment before Prefect reads them."""
import json
import os

with open({SETTINGS_FILE!r}, encoding="utf-8") as fh:
    os.environ.update({{str(k): str(v) for k, v in json.load(fh).items()}})
'''
META_INSTANCE = "prefect_worker_instance"
MAX_WARM_KEYS = 8


def fixed_env(sandbox_env: Mapping[str, str]) -> dict[str, str]:
    """The part of a flow run's env its warm interpreter must have been imported under."""
    return {
        k: v
        for k, v in sandbox_env.items()
        if (k.startswith("PREFECT_") and not k.startswith("PREFECT__")) or k.startswith("PYTHON")
    }


def warm_start_for(configuration: WarmConfiguration) -> WarmStart | None:
    """The warm key of a prepared flow-run configuration; None when it must run cold
    (no warm pool asked for, or a command other than the pool type's default)."""
    if configuration.warm_pool_size <= 0 or (configuration.command or "").strip() != DEFAULT_COMMAND:
        return None
    env = fixed_env(configuration.sandbox_env())
    secrets = {k: env.pop(k) for k in SECRET_SETTINGS if k in env}
    files: dict[str, str | bytes] = {}
    modules: tuple[str, ...] = ENGINE_MODULES
    if secrets:
        files = {SETTINGS_FILE: json.dumps(secrets), f"/work/.warm/{SETTINGS_MODULE}.py": SETTINGS_LOADER}
        modules = (SETTINGS_MODULE, *ENGINE_MODULES)
    return WarmStart(
        template=configuration.template, python=WARM_ARGV[0], modules=modules, env=env, files=files
    )


def warm_command(standby: Standby, env_file: str) -> str:
    """The flow run's command on a standby: the env file sourced, then the engine via the attach."""
    return f". {env_file} && exec {standby.command(list(WARM_ARGV))}"


def server_identity(config: ConnectionConfig) -> str:
    """Which PandaStack API and key a standby was made with (a standby serves only the same):
    a hash, so neither the key nor its prefix sits in the worker's memory as a dict key."""
    return hashlib.sha256(f"{config.api_url or ''}\0{config.api_key or ''}".encode()).hexdigest()[:16]


PoolFactory = Callable[..., StandbyPool]


class WarmPools:
    """The worker's standby pools, one per (PandaStack API, warm key), made on first use.

    ``take`` never waits: a key seen for the first time starts its pool and that flow run goes
    cold; so does any run when no standby is ready. At most ``MAX_WARM_KEYS`` pools: past that a
    new key runs cold (a deployment per env would otherwise grow standbys without bound).
    """

    def __init__(self, metadata: Mapping[str, str], factory: PoolFactory = StandbyPool) -> None:
        self.metadata = dict(metadata)
        self._factory = factory
        self._pools: dict[tuple[str, str], StandbyPool] = {}
        self._lock = threading.Lock()
        self._closed = False

    def pool_for(
        self,
        api_url: str,
        warm: WarmStart,
        size: int,
        client_factory: Callable[[], pandastack.Client],
        redactor: Redactor,
    ) -> StandbyPool | None:
        """The started pool of this key (made now if new); None once closed or over the cap."""
        with self._lock:
            if self._closed:
                return None
            key = (api_url, warm.key())
            pool = self._pools.get(key)
            if pool is None:
                if len(self._pools) >= MAX_WARM_KEYS:
                    logger.warning("warm pools: %d keys already; this flow run runs cold", MAX_WARM_KEYS)
                    return None
                pool = self._factory(
                    client_factory, warm, size=size, metadata=self.metadata, redactor=redactor
                )
                self._pools[key] = pool
                pool.start()
            return pool

    def take(self, configuration: WarmConfiguration) -> Standby | None:
        """A ready standby for this flow run's configuration, or None (run cold)."""
        pool = self.ensure(configuration)
        return pool.take() if pool is not None else None

    def ensure(self, configuration: WarmConfiguration) -> StandbyPool | None:
        """The started pool of a prepared configuration's key; None when it runs cold."""
        warm = warm_start_for(configuration)
        if warm is None:
            return None
        creds = configuration.resolved_credentials()
        return self.pool_for(
            server_identity(creds.connection_config()),
            warm,
            configuration.warm_pool_size,
            creds.get_client,
            configuration.redactor(),
        )

    @property
    def pools(self) -> list[StandbyPool]:
        with self._lock:
            return list(self._pools.values())

    def close(self) -> None:
        """Close every pool (its untaken standbys deleted); later ``take`` calls run cold."""
        with self._lock:
            self._closed = True
            pools = list(self._pools.values())
            self._pools.clear()
        for pool in pools:
            try:
                pool.close()
            except Exception as exc:  # noqa: BLE001 - one failed close must not leave the others
                logger.warning("closing a standby pool failed: %s", exc)
