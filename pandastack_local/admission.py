"""Admission by real use, and the pressure guard that keeps an overcommitted host safe.

A sandbox's memory limit is a ceiling, not a reservation: an idle ``base`` sandbox uses about
8 MB of its 2 GiB. Admitting by the sum of limits (the ``limits`` policy) refuses the 11th
sandbox on a 24 GiB host; admitting by what the live sandboxes actually use (``usage``, the
default) lets hundreds live at once. The price of overcommit is that the host can run short,
so a guard watches the total: past the budget, the sandbox furthest above its fair share
(budget / live sandboxes) is squeezed to what it uses now, and its next allocation makes the
kernel's memory-cgroup OOM killer stop its job (exit 137: a redeliverable failure). Neither the
server nor a neighbour within its fair share is ever the one stopped. Without a memory cgroup
nothing can be measured or squeezed, and ``usage`` falls back to ``limits``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from pandastack_local.isolation.cgroups import Cgroups
from pandastack_local.templates.registry import Template

log = logging.getLogger(__name__)

ADMISSIONS = ("usage", "limits")
DEFAULT_ADMISSION = "usage"
# What a new sandbox is counted as until it can be measured (an idle one uses about 8 MB).
START_RESERVE_MB = 32
# A squeezed sandbox may still grow this much before its job is stopped (v1 refuses a limit
# below the current usage, so the squeeze is usage plus a margin).
SQUEEZE_MARGIN_BYTES = 4 * 1024 * 1024
MB = 1024 * 1024
# The server's own OOM score adjustment (-1000 would exempt it entirely; this keeps it last).
SERVER_OOM_SCORE_ADJ = -900


@dataclass(frozen=True)
class Occupant:
    """One live sandbox as admission sees it: its cgroup name and its template."""

    name: str
    template: Template

    @property
    def limit_mb(self) -> int:
        return self.template.memory_mb


class Admission:
    """Decides whether a create fits, and relieves memory pressure when the host runs short."""

    def __init__(self, policy: str, budget_mb: int | None, cgroups: Cgroups) -> None:
        if policy not in ADMISSIONS:
            raise ValueError(f"admission must be one of {', '.join(ADMISSIONS)}, not {policy!r}")
        self.budget_mb = budget_mb
        self.cgroups = cgroups
        self.measurable = "memory" in cgroups.bases
        if policy == "usage" and not self.measurable:
            log.warning(
                "admission: no memory cgroup to measure sandboxes by: admitting by the sum of "
                "memory limits (--admission limits) instead"
            )
        self.policy = policy if self.measurable else "limits"
        self.squeezed: dict[str, int] = {}  # name -> the oom_kill count when it was squeezed
        # The guard's actions by name, for /metrics (pandastack_local/metrics.py): one line per action.
        self.actions: Counter[str] = Counter()

    def describe(self) -> str:
        if self.budget_mb is None:
            return "admission: no memory budget"
        what = "actual use" if self.policy == "usage" else "the sum of memory limits"
        return f"admission: by {what}, within a {self.budget_mb} MB budget"

    def used_mb(self, occupants: Iterable[Occupant]) -> int:
        """What the live sandboxes count for: their limits, or what they use (at least the
        start reserve each, so a burst of creates cannot all squeeze into one measurement)."""
        if self.policy == "limits":
            return sum(o.limit_mb for o in occupants)
        return sum(max(self._usage_bytes(o.name) // MB, START_RESERVE_MB) for o in occupants)

    def refusal(
        self,
        occupants: Iterable[Occupant],
        pending_mb: int,
        pending: int,
        limit_mb: int,
        count: int,
        copy_of: str | None = None,
        reserved_mb: int = 0,
    ) -> str | None:
        """None when ``count`` sandboxes of ``limit_mb`` fit, else the 507's message. ``copy_of``:
        they are forks of that sandbox, and each starts with a copy of what it uses (memory under
        gVisor, its disk's tmpfs pages under bwrap), not with the start reserve. ``reserved_mb``:
        what admitted memory forks' children not started yet will take (``need_mb``)."""
        if self.budget_mb is None:
            return None
        used = self.used_mb(occupants) + reserved_mb
        used += pending_mb if self.policy == "limits" else pending * START_RESERVE_MB
        need = self.need_mb(limit_mb, count, copy_of)
        if used + need <= self.budget_mb:
            return None
        basis = "in use" if self.policy == "usage" else "of memory limits"
        return (
            f"insufficient host memory for sandbox: need {need} MB, {max(self.budget_mb - used, 0)} MB "
            f"free of the {self.budget_mb} MB budget ({used} MB {basis})"
        )

    def need_mb(self, limit_mb: int, count: int, copy_of: str | None = None) -> int:
        """What ``count`` new sandboxes of ``limit_mb`` count for (see ``refusal``)."""
        if self.policy == "limits":
            return limit_mb * count
        each = START_RESERVE_MB
        if copy_of is not None:
            each = max(each, self._usage_bytes(copy_of) // MB)
        return min(limit_mb, each) * count

    def relieve(self, occupants: list[Occupant]) -> str | None:
        """One pass of the pressure guard: over budget, squeeze the sandbox furthest above its
        fair share; lift squeezes whose job was stopped or that shrank. Returns the name squeezed."""
        if self.policy != "usage" or self.budget_mb is None or not occupants:
            return None
        usage = {o.name: self._usage_bytes(o.name) for o in occupants}
        self._lift(occupants, usage)
        total_mb = sum(usage.values()) // MB
        if total_mb <= self.budget_mb:
            return None
        fair = self.budget_mb * MB // len(occupants)
        over = [o for o in occupants if usage[o.name] > fair and o.name not in self.squeezed]
        if not over:
            return None
        victim = max(over, key=lambda o: usage[o.name])
        if self.cgroups.set_memory_limit(victim.name, usage[victim.name] + SQUEEZE_MARGIN_BYTES):
            self.squeezed[victim.name] = self.cgroups.oom_kills(victim.name)
            self.actions["squeeze"] += 1
            log.warning(
                "memory pressure: %d MB in use past the %d MB budget: sandbox %s (%d MB, fair share "
                "%d MB) is held at its current use; its next allocation stops its job",
                total_mb,
                self.budget_mb,
                victim.name,
                usage[victim.name] // MB,
                fair // MB,
            )
            return victim.name
        return None

    def forget(self, name: str) -> None:
        self.squeezed.pop(name, None)

    def _lift(self, occupants: list[Occupant], usage: dict[str, int]) -> None:
        """Give a squeezed sandbox its limit back once its job was stopped (an OOM kill counted)
        or it shrank below its fair share."""
        if not self.squeezed:
            return
        fair = (self.budget_mb or 0) * MB // max(len(occupants), 1)
        for o in occupants:
            if o.name not in self.squeezed:
                continue
            killed = self.cgroups.oom_kills(o.name) > self.squeezed[o.name]
            if killed or usage[o.name] < fair:
                self.cgroups.set_memory_limit(o.name, self.cgroups.memory_limit_bytes(o.template))
                del self.squeezed[o.name]
                self.actions["lift"] += 1
        for name in set(self.squeezed) - {o.name for o in occupants}:
            del self.squeezed[name]

    @staticmethod
    def protect_server() -> bool:
        """Make the host's OOM killer pass over the server (root only: lowering needs
        CAP_SYS_RESOURCE). Sandboxes give it up as they start (``process.launch``)."""
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write(str(SERVER_OOM_SCORE_ADJ))
            return True
        except OSError:
            return False

    def _usage_bytes(self, name: str) -> int:
        return self.cgroups.memory_usage(name) or 0
