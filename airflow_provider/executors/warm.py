"""Warm starts for ``PandaStackExecutor``: tries launched in standbys of the core's ``StandbyPool``.

A cold try spends most of its time starting a fresh interpreter and importing the Task SDK
inside its sandbox. With ``[pandastack_executor] warm_pool_size = N`` the executor keeps N
*standbys* ready: fresh sandboxes in which a provider-owned runner has already imported
the Task SDK's workload modules under the section's runtime environment and waits (idle, zero CPU) for
one try. A try takes a ready standby, the runner forks the workload there, and the standby is
deleted with the try: every try still gets a sandbox no other try touched.

A standby serves a try only when the try would have imported the same thing: the same
template, interpreter and module form of the command, and the same *import environment*
(:data:`IMPORT_ENV_PREFIXES`: Airflow reads its ``AIRFLOW_*`` settings at import, the
interpreter its ``PYTHON*`` and the loader its ``LD_*`` variables). Any other task env
reaches ``os.environ`` of the forked try at run time, so it does not split the pool.
Otherwise, or when no standby is ready, the try goes cold exactly as without a pool.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import pandastack

from pandastack_jobs import Redactor, Standby, StandbyPool, WarmStart

__all__ = [
    "IMPORT_ENV_PREFIXES",
    "WarmPools",
    "fits",
    "import_env",
]

logger = logging.getLogger(__name__)

IMPORT_ENV_PREFIXES = ("AIRFLOW", "PYTHON", "LD_")
# Standbys started at once while a pool refills after a burst (two: the refill of six taken at
# once should not take six serial starts, nor take every core from the tries running).
FILL_CONCURRENCY = 2


def import_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of ``env`` an interpreter and Airflow read while starting and importing."""
    return {k: v for k, v in env.items() if k.upper().startswith(IMPORT_ENV_PREFIXES)}


def fits(warm: WarmStart, template: str, argv: Sequence[str], env: Mapping[str, str]) -> bool:
    """May a try (its template, cold argv and env) run in a standby of ``warm``?"""
    return (
        warm.template == template
        and len(argv) >= 3
        and argv[0] == warm.python
        and argv[1] == "-m"
        and argv[2] in warm.modules
        and import_env(warm.env) == import_env(env)
    )


class _Pool(Protocol):
    def start(self) -> object: ...
    def take(self) -> Standby | None: ...
    def close(self) -> None: ...


PoolFactory = Callable[..., _Pool]


class WarmPools:
    """One :class:`~pandastack_jobs.StandbyPool` per warm key, and the choice of one for a try."""

    def __init__(
        self,
        client_factory: Callable[[], pandastack.Client],
        warms: Sequence[WarmStart],
        size: int,
        *,
        metadata: Mapping[str, str],
        redactor: Redactor | None = None,
        pool_factory: PoolFactory = StandbyPool,
    ) -> None:
        self._pools: dict[str, tuple[WarmStart, _Pool]] = {}
        for warm in warms:
            if warm.key() not in self._pools:
                pool = pool_factory(
                    client_factory, warm, size=size, metadata=dict(metadata), redactor=redactor
                )
                self._pools[warm.key()] = (warm, pool)

    @property
    def keys(self) -> list[str]:
        return list(self._pools)

    def start(self) -> None:
        for _, pool in self._pools.values():
            pool.start()

    def take(self, template: str, argv: Sequence[str], env: Mapping[str, str]) -> Standby | None:
        """A ready standby this try may use, or None (the try goes cold)."""
        for warm, pool in self._pools.values():
            if fits(warm, template, argv, env):
                return pool.take()
        return None

    def close(self) -> None:
        """Stop filling and delete every untaken standby (a taken one goes with its try)."""
        for key, (_, pool) in self._pools.items():
            try:
                pool.close()
            except Exception:  # the standbys' idle TTL is the backstop
                logger.warning("could not close the standby pool %s", key, exc_info=True)
