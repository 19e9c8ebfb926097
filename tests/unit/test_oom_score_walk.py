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
