"""The memory guard under a hostile tenant (issue 34), through the real SDK, with a lowered budget
so this shared machine stays safe (each test's sandboxes use at most about 1.9 GB at their peak).

An attacker admits many idle sandboxes (cheap under admission by use) and makes a few of them grow
at once; an honest neighbour runs a steady ~120 MB job. The guard must stop the attackers' jobs,
never the neighbour's, and bring the total back under the budget within a bound. Each kind of
memory a job can make the kernel charge to its sandbox is tried: anonymous memory, files on its
own disk (tmpfs: page cache that cannot be dropped), ``/dev/shm``, and a forked child's.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pandastack
import pytest

from pandastack_local.testing.procs import descendants
from tests.support.server import GVISOR

BUDGET_MB = 1000
IDLE_ATTACKERS = 12
GROWERS = 4
GROW_MB = 300
NEIGHBOUR_MB = 120
# How many guard passes in a row may find the total over the budget: the 2 s at the
# guard's 0.5 s interval. Counted in passes, not seconds: on a loaded host (CI's lanes reach a
# load of 98 on 2 cores) every pass comes late alike; the seconds are reported beside it.
OVER_BUDGET_BOUND_PASSES = 4

# argv: KIND MB HOLD. Grows by KIND in 10 MB steps to MB, holds HOLD s, prints "held MB".
# ``steady`` (the neighbour): keeps MB for HOLD s while it keeps allocating, as a real job does.
GROW = r"""
import os, sys, time
kind, target, hold = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
MB = 1024 * 1024
STEP = 10
def page_touched(n):
    b = bytearray(n * MB)
    b[::4096] = b"\1" * len(b[::4096])
    return b
def grow(kind, target):
    held, done = [], 0
    while done < target:
        if kind == "anon":
            held.append(page_touched(STEP))
        elif kind == "file":
            with open(f"/work/blob{done}", "wb") as f:
                f.write(b"\1" * (STEP * MB))
        elif kind == "shm":
            where = "/dev/shm" if done < 50 else "/work"
            with open(f"{where}/blob{done}", "wb") as f:
                f.write(b"\1" * (STEP * MB))
        done += STEP
        time.sleep(0.02)
    return held
if kind == "steady":
    # A steady job: it keeps MB less 40, and works in a 40 MB buffer it takes and gives back.
    held = grow("anon", target - 40)
    end = time.monotonic() + hold
    while time.monotonic() < end:
        work = page_touched(40)
        del work
        time.sleep(0.05)
elif kind == "child":
    pid = os.fork()
    if pid == 0:
        held = grow("anon", target)
        time.sleep(hold)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        sys.exit(128 + (status & 0x7F) if status & 0x7F else status >> 8)
else:
    held = grow(kind, target)
    time.sleep(hold)
print("held", target, flush=True)
"""


@dataclass
class Sample:
    at: float
    used_mb: int | None
    passes: int
    over: int


@dataclass
class Tracker:
    """Polls /healthz's memory section: the total the guard sees, and its counts."""

    url: str
    samples: list[Sample] = field(default_factory=list)
    last: dict[str, Any] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def finish(self) -> None:
        """Stop polling (idempotent); the samples are complete once this returns."""
        self.stop.set()
        if self.thread is not None:
            self.thread.join(5)

    def run(self) -> None:
        with httpx.Client(timeout=5) as http:
            while not self.stop.wait(0.1):
                try:
                    body = http.get(f"{self.url}/healthz").json()
                except (httpx.HTTPError, ValueError):
                    continue
                self.last = body
                memory = body.get("memory") or {}
                guard = memory.get("guard") or {}
                self.samples.append(
                    Sample(
                        time.monotonic(),
                        memory.get("used_mb"),
                        guard.get("passes", 0),
                        guard.get("passes_over_budget", 0),
                    )
                )

    def used(self) -> list[int | None]:
        return [s.used_mb for s in self.samples]

    def longest_over_passes(self) -> int:
        """The most guard passes in a row that found the total over the budget. Between two
        samples where some passes fitted, the run restarts with the over-budget ones counted last
        (an upper bound)."""
        longest = run = 0
        for before, after in zip(self.samples, self.samples[1:], strict=False):
            passes, over = after.passes - before.passes, after.over - before.over
            run = run + over if over == passes else over
            longest = max(longest, run)
        return longest

    def longest_over_seconds(self, budget_mb: int) -> float:
        """The longest stretch the total stayed over the budget, in seconds (reported, not bound)."""
        longest, since = 0.0, None
        for s in self.samples:
            if s.used_mb is not None and s.used_mb > budget_mb:
                since = s.at if since is None else since
                longest = max(longest, s.at - since)
            else:
                since = None
        return longest

    def over_budget_report(self, budget_mb: int) -> str:
        """A short account for an assertion message (CI prints only part of a long one)."""
        over = [
            (round(s.at - self.samples[0].at, 1), s.used_mb, s.passes, s.over)
            for s in self.samples
            if s.used_mb is not None and s.used_mb > budget_mb
        ]
        return (
            f"longest over the budget: {self.longest_over_passes()} passes in a row, "
            f"{self.longest_over_seconds(budget_mb):.1f} s; {len(self.samples)} samples; "
            f"over-budget samples (t, used_mb, passes, over): {over[:40]}"
        )


def _needs_memory_cgroup(server: Any) -> None:
    if "memory" not in server.active_limits():
        pytest.skip("no memory cgroup (a non-root server on cgroup v1): usage cannot be measured")


@dataclass
class Crowd:
    """A server under a lowered memory budget, its /healthz tracker (not yet started) and its
    sandboxes: ``neighbour`` (the honest one) and ``others``, each with /work/grow.py."""

    server: Any
    tracker: Tracker
    neighbour: Any
    others: list[Any]


@contextlib.contextmanager
def _crowd(
    make_local_server: Callable[..., Any],
    make_template: Callable[..., Any],
    *,
    others: int,
    budget_mb: int,
    disk_mb: int,
) -> Iterator[Crowd]:
    """The set-up both crowd tests share. On the way out, whatever happened, the tracker stops
    and every sandbox made here is killed (the server's fixture stops the server)."""
    roomy = make_template(name="roomy", cpu=1, memory_mb=1024, disk_mb=disk_mb)
    server = make_local_server(template_dirs=[roomy], pool_size=0, memory_budget_mb=budget_mb)
    _needs_memory_cgroup(server)
    # Not the SDK's 30 s: CI's lanes load this 2-core host to 98, and these tests bound the guard's
    # passes, not how fast a starved host answers.
    client = server.client(timeout=120)
    boxes: list[Any] = []
    tracker = Tracker(server.url)
    try:
        for _ in range(1 + others):
            boxes.append(client.sandboxes.create(template="roomy"))
        for sb in boxes:
            sb.filesystem.write("/work/grow.py", GROW)
        yield Crowd(server, tracker, boxes[0], boxes[1:])
    finally:
        tracker.finish()
        for sb in boxes:
            try:
                sb.kill()
            except pandastack.NotFoundError:
                pass


def _run(sb: Any, cmd: str) -> Any:
    try:
        return sb.exec(cmd, timeout_seconds=90)
    except Exception as exc:  # the sandbox itself stopped (gVisor, or tmpfs memory): the job failed
        return exc


def _stopped(outcome: Any) -> bool:
    """The job was stopped by the guard: SIGKILLed (137, as an OOM kill) or its sandbox stopped."""
    if isinstance(outcome, Exception):
        return isinstance(outcome, (pandastack.ServerError, pandastack.NotFoundError))
    failed = outcome.exit_code != 0 and "held" not in outcome.stdout
    return bool(outcome.exit_code == 137 or (GVISOR and failed))


@pytest.mark.parametrize("kind", ["anon", "file", "shm", "child"])
def test_the_guard_stops_the_attackers_never_the_neighbour(
    make_local_server, make_template, kind: str
) -> Any:
    """Seen failing on the old guard (fair share = budget / all sandboxes, so idle attackers shrank
    it to 58 MB): it held each grower at its use (nothing reclaimed), the total stayed over the
    budget, and it moved on to the neighbour, whose next allocation was OOM-killed (exit 137)."""
    with _crowd(
        make_local_server, make_template, others=IDLE_ATTACKERS, budget_mb=BUDGET_MB, disk_mb=1024
    ) as crowd:
        server, tracker, neighbour, attackers = crowd.server, crowd.tracker, crowd.neighbour, crowd.others
        growers = attackers[:GROWERS]
        tracker.start()
        with concurrent.futures.ThreadPoolExecutor(1 + GROWERS) as pool:
            calm = pool.submit(_run, neighbour, f"python3 /work/grow.py steady {NEIGHBOUR_MB} 8")
            time.sleep(0.5)  # the neighbour holds its memory first: it is no newcomer
            grown = [pool.submit(_run, sb, f"python3 /work/grow.py {kind} {GROW_MB} 8") for sb in growers]
            outcome = calm.result()
            outcomes = [f.result() for f in grown]
        tracker.finish()
        assert not isinstance(outcome, Exception), outcome
        assert outcome.exit_code == 0 and outcome.stdout.strip() == f"held {NEIGHBOUR_MB}", outcome
        stopped = [o for o in outcomes if _stopped(o)]
        # Four growers of 300 MB take the total past the budget by more than one grower, however
        # their growth interleaves: at least two jobs must go.
        assert len(stopped) >= 2, (outcomes, server.log_tail(60))
        for o in outcomes:
            assert _stopped(o) or (o.exit_code == 0 and "held" in o.stdout), o
        used = tracker.used()
        report = tracker.over_budget_report(BUDGET_MB)
        assert any(u is not None and u > BUDGET_MB for u in used), used  # the attack did cross it
        print(report)
        assert tracker.longest_over_passes() <= OVER_BUDGET_BOUND_PASSES, report
        assert used[-1] is not None and used[-1] <= BUDGET_MB, (used[-5:], report)
        guard = tracker.last["memory"]["guard"]
        assert guard["jobs_stopped"] + guard["sandboxes_stopped"] >= len(stopped), guard
        assert "memory guard:" in server.log_tail(400)
        # The idle attackers and the neighbour were never touched: they work on.
        for sb in [neighbour, *attackers[GROWERS:]]:
            assert sb.exec("echo ok").stdout == "ok\n"
        assert server.running()


def _cgroups(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return ""


def _sandbox_processes(server_pid: int, sandbox_id: str) -> list[int]:
    """The host processes of sandbox ``sandbox_id``: those in its cgroups; a server without
    cgroups (non-root on cgroup v1) makes none, so there (one sandbox in the test) the sandbox's
    launcher (bwrap or runsc) under the server and everything below it."""
    under = descendants(server_pid)
    mine = [p for p in under if sandbox_id in _cgroups(p)]
    if mine:
        return mine
    roots = [p for p in under if Path(_cmd0(p)).name in ("bwrap", "runsc")]
    return sorted({q for r in roots for q in (r, *descendants(r))})


def _cmd0(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def _adj(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/oom_score_adj").read_text())
    except (OSError, ValueError):
        return None


def test_the_hosts_oom_killer_picks_a_sandbox_before_the_server(make_local_server, make_template) -> None:
    """Past the guard (a job faster than its scan), the kernel's own OOM killer decides. Every host
    process of a sandbox (bwrap and its agent, or gVisor's sentry and gofer; raising needs no
    privilege) runs with oom_score_adj 800 and its jobs with 1000, so the kernel kills inside a
    sandbox before it touches the server (-900 where it may lower its score, else 0) or an
    orchestrator (0). Seen failing before: the sandboxes' processes ran at 0, level with the
    server and the engine's worker."""
    small = make_template(name="small", cpu=1, memory_mb=512, disk_mb=64)
    server = make_local_server(template_dirs=[small], pool_size=0, memory_budget_mb=600)
    client = server.client()
    with client.sandboxes.create(template="small") as sb:
        sb.filesystem.write("/work/grow.py", GROW)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            job = pool.submit(sb.exec, "python3 /work/grow.py anon 60 2", timeout_seconds=60)
            seen: dict[int, int] = {}
            while not job.done():  # every host process in the sandbox's cgroups while its job runs
                seen |= {
                    p: a for p in _sandbox_processes(server.pid or 0, sb.id) if (a := _adj(p)) is not None
                }
                time.sleep(0.05)
            assert job.result().exit_code == 0
        # Within the sandbox a job cannot take back the sandbox's place in line: on a root server
        # the sandbox's score is its floor (the kernel's oom_score_adj_min).
        lowered = sb.exec("echo 0 > /proc/self/oom_score_adj; cat /proc/self/oom_score_adj").stdout.split()
    server_adj = _adj(server.pid or 0)
    assert server_adj is not None and server_adj <= 0, server_adj
    assert seen, "no sandbox process found under the server"
    assert min(seen.values()) >= 800, seen
    if not GVISOR:  # gVisor: the job is inside the sentry; the kernel can only pick the sandbox whole
        assert 1000 in seen.values(), seen  # the job itself, first in line
    if not GVISOR and server_adj == -900:
        assert lowered and lowered[-1] != "0", lowered


def test_a_job_that_lowers_its_sandboxs_oom_score_is_put_back_ahead_of_the_server(
    make_local_server, make_template
) -> None:
    """A server that may not lower its own score (a non-root one, or root without CAP_SYS_RESOURCE,
    as in a default container) sets no floor for its sandboxes: a job could lower itself, a
    daemonised holder and its agent (PID 1) to 0, level with the server and any orchestrator, and a
    host OOM then picks the biggest of them, the server among them. The guard raises every process
    of every sandbox back to 800 on each pass. Seen failing before (red team, root without
    CAP_SYS_RESOURCE): the holder and the agent stayed at 0 for good; and on a non-root server on
    cgroup v1 (no cgroups, so no guard pass ran: CI's test-nonroot) they stayed at 0 too."""
    small = make_template(name="small", cpu=1, memory_mb=512, disk_mb=64)
    server = make_local_server(template_dirs=[small], pool_size=0, memory_budget_mb=600)
    client = server.client()
    with client.sandboxes.create(template="small") as sb:
        hold = "exec python3 -c 'import time; time.sleep(60)'"
        out = sb.exec(
            "echo 0 > /proc/1/oom_score_adj; "
            f"(echo 0 > /proc/self/oom_score_adj; {hold}) </dev/null >/dev/null 2>&1 & "
            "sleep 0.5; echo started"
        )
        assert out.stdout.strip() == "started", out
        deadline = time.monotonic() + 5
        while True:
            mine = _sandbox_processes(server.pid or 0, sb.id)
            seen = {p: a for p in mine if (a := _adj(p)) is not None}
            if (seen and min(seen.values()) >= 800) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(seen) >= 2, seen  # the holder and the sandbox's own processes
        assert min(seen.values()) >= 800, seen


HOLDERS = 16
# With its agent (about 8 MB; under gVisor the sentry, about 28 MB), just over the 32 MB start
# reserve: no longer "idle" by size alone.
HOLDER_FILE_MB = 10 if GVISOR else 30
HOLDERS_BUDGET_MB = 900
HOLDERS_NEIGHBOUR_MB = 350


def test_idle_holders_are_reclaimed_before_a_neighbours_running_job(make_local_server, make_template) -> None:
    """The red team's attack: many sandboxes each hold a little over the start reserve in a file on
    their own tmpfs disk, with no job running, so they count as users and shrink the share; the
    neighbour's running job is then the only one above it. Memory no job holds is reclaimed first:
    the holders are stopped whole (never a "job" stop, which frees nothing of theirs) and the
    neighbour finishes. Seen failing before: the guard stopped the neighbour's job (exit 137) and
    the holders kept their memory. Peak about 1 GB."""
    with _crowd(
        make_local_server, make_template, others=HOLDERS, budget_mb=HOLDERS_BUDGET_MB, disk_mb=256
    ) as crowd:
        server, tracker, neighbour, holders = crowd.server, crowd.tracker, crowd.neighbour, crowd.others
        for sb in holders:  # the file stays; the job that wrote it ends
            out = sb.exec(f"python3 /work/grow.py file {HOLDER_FILE_MB} 0")
            assert out.exit_code == 0, out
        tracker.start()
        deadline = time.monotonic() + 10
        while not tracker.samples and time.monotonic() < deadline:
            time.sleep(0.1)
        before = tracker.samples[-1].used_mb
        assert before is not None and before < HOLDERS_BUDGET_MB, (before, "the holders alone fit")
        outcome = _run(neighbour, f"python3 /work/grow.py steady {HOLDERS_NEIGHBOUR_MB} 6")
        tracker.finish()
        assert not isinstance(outcome, Exception), (outcome, server.log_tail(40))
        assert outcome.exit_code == 0 and outcome.stdout.strip() == f"held {HOLDERS_NEIGHBOUR_MB}", (
            outcome,
            server.log_tail(40),
        )
        used = tracker.used()
        assert any(u is not None and u > HOLDERS_BUDGET_MB for u in used), used  # it did cross
        report = tracker.over_budget_report(HOLDERS_BUDGET_MB)
        print(report)
        assert tracker.longest_over_passes() <= OVER_BUDGET_BOUND_PASSES, report
        guard = tracker.last["memory"]["guard"]
        assert guard["jobs_stopped"] == 0 and guard["sandboxes_stopped"] >= 1, guard
        gone = 0
        for sb in holders:
            try:
                sb.exec("true")
            except (pandastack.ServerError, pandastack.NotFoundError):
                gone += 1
        assert gone == guard["sandboxes_stopped"], (gone, guard)
        assert "MB: sandbox, no job running)" in server.log_tail(400)
        assert neighbour.exec("echo ok").stdout == "ok\n"


def test_a_neighbour_whose_job_writes_files_is_not_stopped_for_a_hog(
    make_local_server, make_template
) -> None:
    """The red team's answer to counting a running sandbox's tmpfs files as "held, no job": a
    neighbour whose job writes 150 MB of output files and works on, beside a hog whose job holds
    800 MB of its own memory, on a 900 MB budget. The hog's job is the one above its share and is
    stopped; the neighbour finishes. Seen failing with files counted as holding (4ed8e71, now
    reverted): the guard stopped the neighbour's whole sandbox ("153 MB: sandbox, files held")
    and the hog kept its 800 MB."""
    with _crowd(make_local_server, make_template, others=1, budget_mb=900, disk_mb=256) as crowd:
        server, tracker, neighbour, (hog,) = crowd.server, crowd.tracker, crowd.neighbour, crowd.others
        tracker.start()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            calm = pool.submit(_run, neighbour, "python3 /work/grow.py file 150 0 && sleep 8 && echo done")
            time.sleep(1)  # its files are written first: it is no newcomer
            hogged = pool.submit(_run, hog, "python3 /work/grow.py steady 800 8")
            outcome, hog_outcome = calm.result(), hogged.result()
        tracker.finish()
        assert not isinstance(outcome, Exception), (outcome, server.log_tail(40))
        assert outcome.exit_code == 0 and outcome.stdout.strip().endswith("done"), (
            outcome,
            server.log_tail(40),
        )
        assert _stopped(hog_outcome), (hog_outcome, server.log_tail(40))
        assert neighbour.exec("echo ok").stdout == "ok\n"
        assert server.running()
