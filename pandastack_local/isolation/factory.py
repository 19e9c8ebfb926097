"""The backend for a name: beside the implementations, so the interface (backend.py) imports none."""

from __future__ import annotations

from pandastack_local.isolation.backend import ISOLATIONS, IsolationBackend
from pandastack_local.isolation.cgroups import Cgroups


def make_backend(isolation_name: str, cgroups: Cgroups, instance: str, runsc: str | None) -> IsolationBackend:
    """The backend named ``isolation_name``; gVisor refuses at once when runsc is not usable."""
    if isolation_name == "bwrap":
        from pandastack_local.isolation.bwrap.backend import BwrapBackend

        return BwrapBackend(cgroups, instance)
    if isolation_name == "gvisor":
        from pandastack_local.isolation.gvisor.backend import GvisorBackend

        return GvisorBackend(cgroups, runsc, instance)
    raise ValueError(f"isolation must be one of {', '.join(ISOLATIONS)}, not {isolation_name!r}")
