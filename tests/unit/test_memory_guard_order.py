"""The memory guard's order (pandastack_local/admission.py), on cgroup files written by the test:
whom it stops, in what order, how far, and what idle sandboxes do to the share. The guard against
real sandboxes and a hostile tenant: tests/security/test_memory_guard.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from pandastack_local.admission import SETTLE_SECONDS, Admission, Occupant
from pandastack_local.isolation.cgroups import MEMORY_LOW_BYTES, Cgroups
from pandastack_local.templates.registry import Template

MB = 1024 * 1024
T = Template(name="t", memory_mb=1024)


def _guard(tmp_path: Path, held_mb: dict[str, int], cache_mb: int = 0, budget_mb: int = 1000) -> Admission:
    """An admission over v2 cgroup files: each sandbox charged ``held_mb`` plus ``cache_mb`` of
    inactive file cache (which is not its working set)."""
    for name, mb in held_mb.items():
        d = tmp_path / name
        d.mkdir(exist_ok=True)
        (d / "memory.current").write_text(str((mb + cache_mb) * MB))
        (d / "memory.stat").write_text(f"anon {mb * MB}\ninactive_file {cache_mb * MB}\n")
    return Admission("usage", budget_mb, Cgroups(instance="t", version="v2", bases={"memory": tmp_path}))


def _occupants(held_mb: dict[str, int], idle: tuple[str, ...] = ()) -> list[Occupant]:
    """Every sandbox runs a job but those named in ``idle``."""
    return [Occupant(name, T, running_job=name not in idle) for name in held_mb]


def test_idle_sandboxes_do_not_shrink_the_share(tmp_path: Path) -> None:
    """25 idle sandboxes and 5 grown ones: the share is the budget less what the idle hold, split
    between the six that use memory, so the 110 MB neighbour is below it and never picked."""
    held = {f"idle{i}": 8 for i in range(25)} | {f"grown{i}": 300 for i in range(5)} | {"neighbour": 110}
    guard = _guard(tmp_path, held, budget_mb=1500)
    plan = guard.relieve(_occupants(held), now=0.0)
    assert plan and all(p.name.startswith("grown") and not p.whole for p in plan), plan
    assert plan[0].share_mb == (1500 - 25 * 8) // 6
    # Enough to fit the budget, and no more: 1810 MB less two 300 MB jobs (less their agents' reserve).
    assert len(plan) == 2, plan


def test_idle_holders_just_over_the_reserve_go_before_a_running_job(tmp_path: Path) -> None:
    """The red team's attack: 28 sandboxes hold 35 MB each in files, no job running (just over the
    idle line, so they would count as users and shrink the share to ~47 MB), beside a neighbour
    running a 140 MB job. Their memory is reclaimed first, each sandbox stopped whole (stopping a
    job they do not run frees nothing), largest first; the neighbour's job is never stopped."""
    held = {f"holder{i}": 35 + (i % 2) for i in range(28)} | {"neighbour": 140}
    holders = tuple(n for n in held if n.startswith("holder"))
    guard = _guard(tmp_path, held, budget_mb=1000)
    plan = guard.relieve(_occupants(held, idle=holders), now=0.0)
    assert plan, plan
    assert all(p.name.startswith("holder") and p.whole and p.idle for p in plan), plan
    assert [p.held_mb for p in plan] == sorted((p.held_mb for p in plan), reverse=True), plan
    # 1140 MB over a 1000 MB budget, less the 50 MB minimum reclaim: four or five holders suffice.
    freed = sum(p.held_mb for p in plan)
    assert freed >= 1140 - 1000 + 1000 // 20 and freed - plan[-1].held_mb < 190, plan


def test_a_sandbox_without_a_running_job_is_never_planned_a_job_stop(tmp_path: Path) -> None:
    """Above its share with no job running (a paused sandbox, a job's leftover files): whole."""
    held = {"paused": 700, "worker": 400}
    guard = _guard(tmp_path, held, budget_mb=1000)
    plan = guard.relieve(_occupants(held, idle=("paused",)), now=0.0)
    assert [(p.name, p.whole) for p in plan] == [("paused", True)], plan
    # Once the idle holders are all stopped, the running jobs come next, by use above the share.
    held = {"paused": 100, "a": 600, "b": 500}
    guard = _guard(tmp_path, held, budget_mb=1000)
    plan = guard.relieve(_occupants(held, idle=("paused",)), now=0.0)
    assert [(p.name, p.whole) for p in plan] == [("paused", True), ("a", False)], plan


def test_the_biggest_above_its_share_goes_first_and_never_one_below_it(tmp_path: Path) -> None:
    held = {"a": 200, "b": 600, "c": 400, "small": 90}
    guard = _guard(tmp_path, held, budget_mb=1000)
    plan = guard.relieve(_occupants(held), now=0.0)
    assert [p.name for p in plan] == ["b"], plan
    held = {"a": 300, "b": 600, "c": 500, "small": 240}
    guard = _guard(tmp_path, held, budget_mb=1000)
    plan = guard.relieve(_occupants(held), now=0.0)
    assert [p.name for p in plan] == ["b", "c"], plan  # 1640 MB less b (568) is still over: c too


def test_page_cache_is_not_held_against_a_sandbox(tmp_path: Path) -> None:
    """What the kernel can drop (inactive file cache) is no offence: the working set fits."""
    held = {"a": 300, "b": 300}
    guard = _guard(tmp_path, held, cache_mb=300, budget_mb=1000)
    assert guard.relieve(_occupants(held), now=0.0) == []
    assert guard.last_total_mb == 600


def test_memory_that_outlives_its_job_stops_the_sandbox_on_the_next_pass(tmp_path: Path) -> None:
    """tmpfs files stay after the job is killed: the next pass (past the settle time) stops the
    sandbox whole; before it, the stopped job's memory counts as on its way back."""
    held = {"hog": 900, "neighbour": 200}
    guard = _guard(tmp_path, held, budget_mb=1000)
    occupants = _occupants(held)
    [first] = guard.relieve(occupants, now=0.0)
    assert (first.name, first.whole) == ("hog", False)
    guard.stopped(first, now=0.0)
    assert guard.relieve(occupants, now=SETTLE_SECONDS / 2) == []
    [second] = guard.relieve(occupants, now=SETTLE_SECONDS + 0.01)
    assert (second.name, second.whole) == ("hog", True)
    guard.stopped(second)
    assert guard.counts.to_json() == {
        "passes": 3,
        "passes_over_budget": 3,
        "jobs_stopped": 1,
        "sandboxes_stopped": 1,
    }


def test_a_stopped_sandbox_that_settled_is_a_new_offender_next_time(tmp_path: Path) -> None:
    held = {"hog": 900, "neighbour": 200}
    guard = _guard(tmp_path, held, budget_mb=1000)
    [first] = guard.relieve(_occupants(held), now=0.0)
    guard.stopped(first, now=0.0)
    settled = {"hog": 10, "neighbour": 200, "other": 900}
    _guard(tmp_path, settled, budget_mb=1000)  # the files again: the hog's job freed its memory
    [pick] = guard.relieve(_occupants(settled), now=1.0)
    assert (pick.name, pick.whole) == ("other", False)
    assert "hog" not in guard.job_stopped


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_memory_low_protects_each_sandbox_up_to_its_admission_on_v2(tmp_path: Path, version: str) -> None:
    cgroups = Cgroups(instance="t", version=version, bases={"memory": tmp_path})
    cgroups.create("sb", T)
    low = tmp_path / "sb" / "memory.low"
    if version == "v2":
        assert low.read_text() == str(MEMORY_LOW_BYTES)
    else:
        assert not low.exists()
