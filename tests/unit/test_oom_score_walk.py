"""keep_ahead's walk up a process's parents on a host without cgroups (process._descends_from):
a /proc tree in memory, so any depth and any name are cheap to build."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pandastack_local.isolation import process


def _stat(pid: int, ppid: int, comm: str = "sh") -> str:
    return f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1\n"


@pytest.fixture
def proc_tree(monkeypatch: pytest.MonkeyPatch) -> dict[int, str]:
    """``/proc/<pid>/stat`` answered from a dict (pid -> stat line) instead of the kernel."""
    tree: dict[int, str] = {}
    real = Path.read_text

    def read_text(self: Path, *args: Any, **kwargs: Any) -> str:
        parts = self.parts
        if len(parts) == 4 and parts[:2] == ("/", "proc") and parts[3] == "stat":
            try:
                return tree[int(parts[2])]
            except (KeyError, ValueError):
                raise FileNotFoundError(str(self)) from None
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    return tree


def test_a_process_any_depth_below_the_launcher_is_the_sandboxs(proc_tree: dict[int, str]) -> None:
    """The red team's chain of 90 nested processes, each lowering its own score: the walk stopped
    after 64 parents, so the deepest 28 were never raised (seen failing before: False)."""
    launcher, depth = 1000, 300
    for i in range(1, depth + 1):
        proc_tree[launcher + i] = _stat(launcher + i, launcher + i - 1)
    proc_tree[launcher] = _stat(launcher, 1, "bwrap")
    assert process._descends_from(proc_tree[launcher + depth], launcher)


def test_a_process_outside_the_tree_or_in_a_loop_is_not(proc_tree: dict[int, str]) -> None:
    proc_tree[50] = _stat(50, 1)
    proc_tree[51] = _stat(51, 50, ") S 1000 1 1 0")  # a name that fakes the end of its comm
    assert not process._descends_from(proc_tree[51], 1000)
    proc_tree[60], proc_tree[61] = _stat(60, 61), _stat(61, 60)  # a loop (pid reuse mid-walk)
    assert not process._descends_from(proc_tree[60], 1000)


def test_a_deep_chain_costs_one_read_of_each_parent_a_pass(
    proc_tree: dict[int, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The red team's chain of 250 processes, each lowering its score again every 0.3 s: every
    one was walked up to the launcher on its own (D^2/2 reads of /proc a pass; four such sandboxes
    made the guard's 0.5 s pass take up to 5.5 s and the server use 67 % of a core). With the pids
    one call has already found below the launcher, each parent is read once (seen failing before:
    31125 reads)."""
    launcher, depth = 1000, 250
    proc_tree[launcher] = _stat(launcher, 1, "bwrap")
    for i in range(1, depth + 1):
        proc_tree[launcher + i] = _stat(launcher + i, launcher + i - 1)
    reads = []
    counted = Path.read_text

    def read_text(self: Path, *args: Any, **kwargs: Any) -> str:
        reads.append(self)
        return counted(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    below = {launcher}
    for pid in range(launcher + 1, launcher + depth + 1):  # the order of the walk: parents first
        assert process._descends_from(proc_tree[pid], launcher, below)
    assert len(reads) <= depth
    assert not process._descends_from(_stat(5000, 4999), launcher, below)  # and a stranger still is not


def test_a_pass_without_cgroups_walks_proc_once_for_every_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard's pass on a host without cgroups (a non-root server on cgroup v1): each sandbox's
    tree comes from one shared walk of /proc, not one walk per sandbox every 0.5 s (seen failing
    before: 40 walks for 40 sandboxes)."""
    from types import SimpleNamespace

    from pandastack_local import manager as manager_mod
    from pandastack_local.admission import Occupant
    from pandastack_local.guest import agent

    walks = []
    table = [(1000 + i, b"S", 1, 1000 + i) for i in range(40)] + [
        (2000 + i, b"S", 1000 + i, 2000) for i in range(40)
    ]

    def walk() -> list[tuple[int, bytes, int, int]]:
        walks.append(1)
        return table

    monkeypatch.setattr(agent, "_processes", walk)
    monkeypatch.setattr(process, "_processes", walk)
    seen: dict[str, list[int]] = {}
    monkeypatch.setattr(
        manager_mod, "keep_ahead", lambda name, pids, launcher=None: seen.setdefault(name, pids) and 0
    )
    m = manager_mod.SandboxManager.__new__(manager_mod.SandboxManager)
    m.cgroups = SimpleNamespace(bases=[])  # type: ignore[assignment]
    m.sandboxes = {f"sb{i}": SimpleNamespace(process=SimpleNamespace(pid=1000 + i)) for i in range(40)}  # type: ignore[assignment,misc]
    m._keep_ahead([Occupant(f"sb{i}", None) for i in range(40)])  # type: ignore[arg-type]
    assert len(walks) == 1
    assert seen == {f"sb{i}": [2000 + i] for i in range(40)}


def test_a_torn_walk_with_a_parent_loop_ends() -> None:
    """A /proc walk taken while a pid was reused can hold a parent loop through the root (the
    red team's reading of descendants(): no guard, so the guard thread would loop for good)."""
    from pandastack_local.guest.agent import descendants

    table = [(1000, b"S", 1002, 0), (1001, b"S", 1000, 0), (1002, b"S", 1001, 0), (1003, b"S", 1001, 0)]
    assert sorted(descendants(1000, table)) == [1001, 1002, 1003]
