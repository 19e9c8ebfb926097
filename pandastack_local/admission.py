"""Admission by real use, and the memory guard that keeps an overcommitted host safe.

A sandbox's memory limit is a ceiling, not a reservation: an idle ``base`` sandbox uses about
8 MB of its 2 GiB. Admitting by the sum of limits (the ``limits`` policy) refuses the 11th
sandbox on a 24 GiB host; admitting by what the live sandboxes actually use (``usage``, the
default) lets hundreds live at once. The price of overcommit is that the host can run short,
so a guard watches the total, as Kubernetes' node-pressure eviction does. Past the budget it
first stops whole the sandboxes that hold more than the start reserve with no job running (files
on their tmpfs disk or in /dev/shm, a paused sandbox: memory no job stop frees), largest first:
running work before idle caches, as the kernel reclaims cache before it kills. Then it
ranks the sandboxes running a job by their working set above their share and stops the job of the first (a
SIGKILL: the exec answers 137, as after an OOM kill, a redeliverable failure), then the next,
until what is left fits the budget. A sandbox whose memory outlives its job (files on its tmpfs
disk or in /dev/shm; under gVisor, anything: the sentry keeps a dead job's pages) is stopped
whole on the next pass (a lost sandbox: redeliverable too).

The share: the budget less what the idle sandboxes hold, split between the sandboxes that run a
job and use memory (more than the start reserve each). Idle sandboxes do not shrink it, so a tenant cannot
make a neighbour the biggest offender by holding many empty sandboxes; and since every sandbox
that uses memory has the same share, ranking by use above it stops the biggest first: a sandbox
is never stopped while one using more is above its share and not stopped. Without a memory
cgroup nothing can be measured or stopped by use, and ``usage`` falls back to ``limits``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from pandastack_local.isolation.cgroups import Cgroups
from pandastack_local.templates.registry import Template

log = logging.getLogger(__name__)

ADMISSIONS = ("usage", "limits")
DEFAULT_ADMISSION = "usage"
# What a new sandbox is counted as until it can be measured (an idle one uses about 8 MB); a
# sandbox holding no more than this counts as idle for the guard's share.
START_RESERVE_MB = 32
MB = 1024 * 1024
# The server's own OOM score adjustment (-1000 would exempt it entirely; this keeps it last).
SERVER_OOM_SCORE_ADJ = -900
# A sandbox whose job was stopped this long ago and that still holds more than its share is
# stopped whole (its memory outlived its job): a little less than the guard's interval, so it
# is the very next pass.
SETTLE_SECONDS = 0.3
# Past the budget, the guard reclaims this much below it too (Kubernetes' minimum reclaim), so an
# offender still growing does not take the total straight back over: a twentieth of the budget.
MIN_RECLAIM_FRACTION = 20


@dataclass(frozen=True)
class Occupant:
    """One live sandbox as admission sees it: its cgroup name and its template."""

    name: str
    template: Template
    # Whether a job runs in it (an exec in flight). Without one, nothing it holds (files on its
    # tmpfs disk or in /dev/shm, a paused sandbox's memory) is freed by stopping a job.
    running_job: bool = True

    @property
    def limit_mb(self) -> int:
        return self.template.memory_mb


@dataclass(frozen=True)
class Stop:
    """One action of the guard: stop ``name``'s job (``whole`` False) or the sandbox itself."""

    name: str
    whole: bool
    held_mb: int  # its working set when it was picked
    share_mb: int
    # Picked as an idle holder (no job running, more than the start reserve), before any job.
    idle: bool = False


@dataclass
class GuardCounts:
    """What the guard did since the server started (``/healthz``)."""

    passes: int = 0  # every pass that measured: a counter that stops moving is a stalled guard
    passes_over_budget: int = 0
    jobs_stopped: int = 0
    sandboxes_stopped: int = 0

    def to_json(self) -> dict[str, int]:
        return asdict(self)  # every count, in field order: a new one needs no second edit


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
        # name -> the monotonic time the guard stopped its job (until it holds no more than its share)
        self.job_stopped: dict[str, float] = {}
        self.counts = GuardCounts()
        # What the guard's last pass measured: the sandboxes' charge, or their working set when
        # the charge was over the budget (what it holds under the budget). None before a pass.
        self.last_total_mb: int | None = None

    @property
    def guarded(self) -> bool:
        return self.policy == "usage" and self.budget_mb is not None

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

    def never_fits(self, template: str, limit_mb: int, count: int) -> str | None:
        """Why ``count`` new sandboxes of ``limit_mb`` could not be admitted even by an empty
        server (their need is over the whole budget), naming the field; None when they can be.
        Such a create is the client's mistake, not a wait: the server answers 400, never the
        507 a client retries (a queue consumer would wait for room that never comes)."""
        need = self.need_mb(limit_mb, count)
        if self.budget_mb is None or need <= self.budget_mb:
            return None
        basis = "counts each sandbox's memory limit" if self.policy == "limits" else "counts its use"
        what = f"template {template!r}: memory_mb {limit_mb}"
        if count > 1:
            what = (
                f"count {count}: {count} sandboxes of template {template!r} "
                f"(memory_mb {limit_mb}) need {need} MB, which"
            )
        return (
            f"{what} is over this server's whole memory budget of {self.budget_mb} MB (--admission "
            f"{self.policy} {basis}): it can never be admitted; use a template with less memory_mb"
            + (" or a smaller count" if count > 1 else "")
            + ", or start the server with a larger --memory-budget-mb"
        )

    def need_mb(self, limit_mb: int, count: int, copy_of: str | None = None) -> int:
        """What ``count`` new sandboxes of ``limit_mb`` count for (see ``refusal``)."""
        if self.policy == "limits":
            return limit_mb * count
        each = START_RESERVE_MB
        if copy_of is not None:
            each = max(each, self._usage_bytes(copy_of) // MB)
        return min(limit_mb, each) * count

    def working_sets(self, occupants: Iterable[Occupant]) -> dict[str, int]:
        """Each sandbox's working set in bytes (what the guard holds under the budget)."""
        return {o.name: self.cgroups.working_set(o.name) or 0 for o in occupants}

    def relieve(self, occupants: list[Occupant], now: float | None = None) -> list[Stop]:
        """One pass of the guard (see the module docstring): what to stop, in order, so that the
        total fits the budget once their memory is freed. Empty while it fits."""
        if not self.guarded or not occupants:
            self.last_total_mb = 0
            return []
        now = time.monotonic() if now is None else now
        self.counts.passes += 1
        # The cheap read first: the working set is never more than the charge.
        usage = {o.name: self._usage_bytes(o.name) for o in occupants}
        budget = (self.budget_mb or 0) * MB
        self.last_total_mb = sum(usage.values()) // MB
        if sum(usage.values()) <= budget:
            return []
        held = self.working_sets(occupants)
        total = sum(held.values())
        self.last_total_mb = total // MB
        reserve = START_RESERVE_MB * MB
        running = {o.name for o in occupants if o.running_job}
        # Idle holders: no job running, more than the reserve. Stopping a job frees nothing of
        # theirs; they are reclaimed whole, before any running job (as the kernel drops cache
        # before it kills), so they never shrink the share of the sandboxes that run jobs.
        holders = [n for n, b in held.items() if b > reserve and n not in running]
        users = [n for n, b in held.items() if b > reserve and n in running]
        idle = total - sum(held[n] for n in users) - sum(held[n] for n in holders)
        share = max((budget - idle) // max(len(users), 1), reserve)
        self._forget_settled(held, share)
        if total <= budget:
            return []
        self.counts.passes_over_budget += 1
        excess = total - budget + budget // MIN_RECLAIM_FRACTION
        plan: list[Stop] = []
        for name in sorted(holders, key=lambda n: held[n], reverse=True):
            if excess <= 0:
                return plan
            stopped_at = self.job_stopped.get(name)
            if stopped_at is not None and now - stopped_at < SETTLE_SECONDS:
                excess -= held[name]  # its job was just stopped: its memory is on its way back
                continue
            plan.append(Stop(name, True, held[name] // MB, share // MB, idle=True))
            excess -= held[name]
        # Then Kubernetes' order: by use above the share (the same share for all: by use), largest first.
        for name in sorted((n for n in users if held[n] > share), key=lambda n: held[n], reverse=True):
            if excess <= 0:
                break
            stopped_at = self.job_stopped.get(name)
            if stopped_at is not None and now - stopped_at < SETTLE_SECONDS:
                excess -= held[name]
                continue
            plan.append(Stop(name, stopped_at is not None, held[name] // MB, share // MB))
            excess -= held[name] - (0 if stopped_at is not None else reserve)
        return plan

    def stopped(self, stop: Stop, now: float | None = None) -> None:
        """The manager carried ``stop`` out: count it, and watch whether its memory comes back."""
        if stop.whole:
            self.counts.sandboxes_stopped += 1
            self.job_stopped.pop(stop.name, None)
        else:
            self.counts.jobs_stopped += 1
            self.job_stopped[stop.name] = time.monotonic() if now is None else now

    def forget(self, name: str) -> None:
        self.job_stopped.pop(name, None)

    def _forget_settled(self, held: dict[str, int], share: int) -> None:
        """A sandbox whose job was stopped and that now holds no more than its share is done with:
        a later job of it that grows is a new offence (its job stopped first, again)."""
        for name in list(self.job_stopped):
            if held.get(name, 0) <= share:
                del self.job_stopped[name]

    @staticmethod
    def protect_server() -> bool:
        """Make the host's OOM killer pass over the server (root only: lowering needs
        CAP_SYS_RESOURCE). Sandboxes are put ahead of it as they start (``process.launch``)."""
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write(str(SERVER_OOM_SCORE_ADJ))
            return True
        except OSError:
            return False

    def _usage_bytes(self, name: str) -> int:
        return self.cgroups.charged(name) or 0
