"""Warm starts on the fake server: the standby pool's bookkeeping and the job's fallback decision."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest

from pandastack_jobs import DetachedJob, JobSpec, Standby, StandbyPool, WarmStart, run_job, start_detached
from pandastack_jobs.lifecycle import JobRun
from pandastack_jobs.testing import FakeClient
from pandastack_jobs.warm_start import (
    ATTACH_PATH,
    RUNNER_PATH,
    STANDBY_LABEL,
    STATE_PATH,
    guest_script,
)

WARM = WarmStart(template="base", modules=("json", "decimal"), env={"PYTHONPATH": "/opt/eng"})
READY = json.dumps({"ready": True, "pid": 7, "preload_seconds": 0.1})


def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def _runner_ready(fake: FakeClient) -> None:
    fake.script("warm_runner.py", files={STATE_PATH: READY})


def _standbys(fake: FakeClient) -> list[str]:
    return [sid for sid in fake.live() if fake.sandbox(sid).metadata.get(STANDBY_LABEL)]


def _pool(fake: FakeClient, **kw: object) -> StandbyPool:
    opts: dict[str, object] = {"size": 2, "metadata": {"team": "eng"}, "idle_ttl": 40}
    opts.update(kw)
    return StandbyPool(lambda: fake, WARM, **opts)  # type: ignore[arg-type]


def test_the_pool_fills_to_size_with_labelled_short_ttl_standbys_running_the_runner(fake: FakeClient) -> None:
    _runner_ready(fake)
    with _pool(fake) as pool:
        _until(lambda: pool.ready == 2)
        assert len(_standbys(fake)) == 2
        for sid in fake.live():
            sb = fake.sandbox(sid)
            assert sb.template == "base"
            assert sb.metadata[STANDBY_LABEL] == WARM.key() and sb.metadata["team"] == "eng"
            assert sb.ttl_seconds == 40  # the idle TTL, not a job's
            assert sb.files[RUNNER_PATH] == guest_script("warm_runner.py")
            assert sb.files[ATTACH_PATH] == guest_script("warm_attach.py")
        launches = [c for c in fake.execs if "warm_runner.py" in c.command]
        assert len(launches) == 2
        line = launches[0].line
        assert "nohup" in line and line.rstrip().endswith("&")  # in the background, as a detached job
        assert "PYTHONPATH=/opt/eng" in line and "json decimal" in line
    assert fake.live() == []


def test_take_hands_out_each_standby_once_and_the_pool_refills(fake: FakeClient) -> None:
    _runner_ready(fake)
    with _pool(fake) as pool:
        _until(lambda: pool.ready == 2)
        first, second = pool.take(), pool.take()
        assert isinstance(first, Standby) and isinstance(second, Standby)
        assert first.sandbox_id != second.sandbox_id and first.warm == WARM
        _until(lambda: pool.ready == 2)
        waiting = set(_standbys(fake)) - {first.sandbox_id, second.sandbox_id}
        assert len(waiting) == 2  # two new ones, the taken ones untouched
    # close() deleted the untaken standbys only: the taken ones belong to their jobs now.
    assert sorted(fake.live()) == sorted([first.sandbox_id, second.sandbox_id])
    assert pool.take() is None
    pool.close()  # idempotent


def test_the_refill_waits_refill_delay_after_the_last_take(fake: FakeClient) -> None:
    _runner_ready(fake)
    with _pool(fake, refill_delay=0.6) as pool:
        _until(lambda: pool.ready == 2)
        launches = lambda: len([c for c in fake.execs if "warm_runner.py" in c.command])  # noqa: E731
        assert launches() == 2
        pool.take()
        time.sleep(0.4)
        pool.take()  # a second take restarts the delay (debounced)
        time.sleep(0.4)
        assert launches() == 2 and pool.ready == 0  # no refill competes with the tries yet
        _until(lambda: pool.ready == 2)
        assert launches() == 4


def test_optional_modules_reach_the_runner_and_the_key(fake: FakeClient) -> None:
    warm = WarmStart(template="base", modules=("json",), optional_modules=("decimal", "no_such_xyz"))
    assert warm.key() != WarmStart(template="base", modules=("json",)).key()
    _runner_ready(fake)
    with StandbyPool(lambda: fake, warm, size=1) as pool:  # type: ignore[arg-type,return-value]
        _until(lambda: pool.ready == 1)
        (launch,) = [c for c in fake.execs if "warm_runner.py" in c.command]
        assert "json --optional decimal --optional no_such_xyz" in launch.line
    with pytest.raises(ValueError):
        WarmStart(template="base", optional_modules=("-c",))


def test_take_returns_none_when_nothing_is_ready(fake: FakeClient) -> None:
    with _pool(fake, size=0) as pool:
        assert pool.take() is None and pool.ready == 0
    assert fake.live() == []


def test_a_standby_whose_runner_died_is_deleted_and_replaced(fake: FakeClient) -> None:
    _runner_ready(fake)
    with _pool(fake, size=1, refresh_seconds=0.05) as pool:
        _until(lambda: pool.ready == 1)
        (dead,) = _standbys(fake)
        fake.script(lambda cmd: "kill -0" in cmd and dead in fake.live(), exit_code=1)
        _until(lambda: dead not in fake.live() and pool.ready == 1)
        assert dead in fake.deleted
        (fresh,) = _standbys(fake)
        assert fresh != dead
    assert fake.live() == []


def test_a_standby_whose_sandbox_vanished_is_replaced(fake: FakeClient) -> None:
    _runner_ready(fake)
    with _pool(fake, size=1, refresh_seconds=0.05) as pool:
        _until(lambda: pool.ready == 1)
        (gone,) = _standbys(fake)
        fake.expire(gone)
        _until(lambda: pool.ready == 1 and gone not in pool.waiting())
        assert _standbys(fake) == pool.waiting()
    assert fake.live() == []


def test_waiting_standbys_are_checked_which_refreshes_their_idle_ttl(fake: FakeClient) -> None:
    _runner_ready(fake)
    with _pool(fake, size=1, refresh_seconds=0.05) as pool:
        _until(lambda: pool.ready == 1)
        (sid,) = _standbys(fake)
        _until(lambda: sum(1 for c in fake.execs if c.sandbox_id == sid and "kill -0" in c.line) >= 2)
        assert pool.ready == 1 and _standbys(fake) == [sid]  # alive: kept


def test_a_runner_that_fails_to_preload_is_deleted_and_reported(fake: FakeClient) -> None:
    fake.script(
        "warm_runner.py", files={STATE_PATH: json.dumps({"ready": False, "error": "No module named x"})}
    )
    with _pool(fake, size=1) as pool:
        _until(lambda: pool.failures >= 1)
        assert pool.ready == 0
        assert pool.last_error is not None and "No module named x" in pool.last_error
        _until(lambda: not fake.live())  # the failed standby is deleted, not kept
    assert fake.live() == []


def test_close_cancels_a_fill_under_way(fake: FakeClient) -> None:
    import threading

    release = threading.Event()
    fake.script("warm_runner.py", wait=release, files={STATE_PATH: READY})
    pool = _pool(fake, size=1).start()
    _until(lambda: len(fake.live()) == 1)  # created, its launch blocked
    pool.close(timeout=5)
    release.set()
    assert fake.live() == [] and pool.ready == 0


# -- the job side: take the standby, or go cold --------------------------------------------------


def _standby(fake: FakeClient) -> Standby:
    sb = fake.add_sandbox(metadata={STANDBY_LABEL: WARM.key()}, template="base", ttl_seconds=40)
    return Standby(sb.id, WARM)


COLD = ["python3", "-m", "engine.run", "--task", "t1"]


def test_a_job_with_a_standby_runs_the_warm_command_there_with_its_own_ttl(fake: FakeClient) -> None:
    standby = _standby(fake)
    command = standby.command(COLD)
    fake.script("warm_attach.py", result={"ok": 1})
    spec = JobSpec(command="python3 -m engine.run --task t1", template="base", timeout=100)
    outcome = run_job(fake, spec, standby=standby, standby_command=command)
    assert outcome.ok and outcome.result == {"ok": 1}
    assert outcome.sandbox_id == standby.sandbox_id and outcome.standby is True
    assert outcome.summary()["standby"] is True
    assert not any(r[0] == "POST" and r[1] == "/sandboxes" for r in fake.requests)  # no create
    patches = [r for r in fake.requests if r[0] == "PATCH"]
    assert patches == [("PATCH", f"/sandboxes/{standby.sandbox_id}/lifecycle", "")]
    (call,) = fake.execs
    assert call.command == command and call.timeout == 100  # under the guest-side clock
    assert fake.live() == []  # deleted with the job


def test_the_taken_standby_gets_the_jobs_ttl(fake: FakeClient) -> None:
    standby = _standby(fake)
    seen: list[int | None] = []
    fake.script("warm_attach.py", action=lambda sb, call: seen.append(sb.ttl_seconds) and None)
    run_job(
        fake,
        JobSpec(command="x", template="base", timeout=100, result_path=None),
        standby=standby,
        standby_command=standby.command(COLD),
    )
    assert seen == [160]  # spec.ttl_seconds: the timeout plus its margin, not the standby's 40


def test_a_standby_gone_before_take_falls_back_to_a_fresh_cold_sandbox(fake: FakeClient) -> None:
    standby = _standby(fake)
    fake.expire(standby.sandbox_id)
    fake.script("engine.run", result={"cold": True})
    spec = JobSpec(command="python3 -m engine.run --task t1", template="base", metadata={"k": "v"})
    run = JobRun(fake, spec)
    outcome = run.run(acquire=lambda: run.take_standby(standby.sandbox_id, standby.command(COLD)), fresh=True)
    assert outcome.ok and outcome.result == {"cold": True} and run.warm is False
    assert outcome.sandbox_id != standby.sandbox_id
    (call,) = fake.execs
    assert call.command == spec.command and "warm_attach" not in call.line  # the cold command
    created = [r for r in fake.requests if r[0] == "POST" and r[1] == "/sandboxes"]
    assert len(created) == 1
    assert fake.live() == []


def test_run_job_falls_back_when_the_standby_is_gone(fake: FakeClient) -> None:
    standby = _standby(fake)
    fake.expire(standby.sandbox_id)
    spec = JobSpec(command="python3 -m engine.run", template="base", result_path=None)
    outcome = run_job(fake, spec, standby=standby, standby_command=standby.command(COLD))
    assert outcome.ok and outcome.sandbox_id not in (None, standby.sandbox_id)
    assert outcome.standby is False
    assert run_job(fake, spec).standby is None  # no standby given
    assert fake.execs[0].command == "python3 -m engine.run"


def test_a_standby_needs_its_command(fake: FakeClient) -> None:
    with pytest.raises(ValueError, match="standby_command"):
        run_job(fake, JobSpec(command="x"), standby=_standby(fake))


def test_start_detached_launches_the_warm_command_in_the_standby(fake: FakeClient) -> None:
    standby = _standby(fake)
    command = standby.command(COLD)
    job = start_detached(
        fake, JobSpec(command="python3 -m engine.run"), standby=standby, standby_command=command
    )
    assert isinstance(job, DetachedJob) and job.sandbox_id == standby.sandbox_id
    (call,) = fake.execs
    assert call.detached and call.command == command
    assert fake.sandbox(standby.sandbox_id).ttl_seconds == JobSpec(command="x").ttl_seconds
    fake.expire(standby.sandbox_id)


def test_start_detached_falls_back_when_the_standby_is_gone(fake: FakeClient) -> None:
    standby = _standby(fake)
    fake.expire(standby.sandbox_id)
    job = start_detached(
        fake, JobSpec(command="python3 -m engine.run"), standby=standby, standby_command="never"
    )
    assert isinstance(job, DetachedJob) and job.sandbox_id != standby.sandbox_id
    assert fake.execs[0].command == "python3 -m engine.run"
    fake.expire(job.sandbox_id)


# -- the warm key and the command ----------------------------------------------------------------


def test_the_key_is_stable_and_changes_with_every_field() -> None:
    assert (
        WARM.key()
        == WarmStart(template="base", modules=["json", "decimal"], env={"PYTHONPATH": "/opt/eng"}).key()
    )  # type: ignore[arg-type]
    others = [
        WarmStart(template="code-interpreter", modules=WARM.modules, env=WARM.env),
        WarmStart(template="base", python="/opt/venv/bin/python", modules=WARM.modules, env=WARM.env),
        WarmStart(template="base", modules=("json",), env=WARM.env),
        WarmStart(template="base", modules=WARM.modules, env={"PYTHONPATH": "/opt/other"}),
        WarmStart(template="base", modules=WARM.modules, env=WARM.env, files={"/work/m.py": "x=1"}),
    ]
    keys = {w.key() for w in others} | {WARM.key()}
    assert len(keys) == len(others) + 1
    assert all(len(k) == 16 for k in keys)


def test_the_command_runs_attach_isolated_with_the_cold_argv_quoted() -> None:
    standby = Standby("sb-1", WARM)
    assert standby.command(["python3", "-m", "mod", "a b", "$HOME"]) == (
        f"python3 -I -S {ATTACH_PATH} python3 -m mod 'a b' '$HOME'"
    )
    with pytest.raises(ValueError):
        standby.command([])


def test_a_check_the_server_cannot_answer_keeps_the_standby(fake: FakeClient) -> None:
    import pandastack

    _runner_ready(fake)
    with _pool(fake, size=1, refresh_seconds=0.05) as pool:
        _until(lambda: pool.ready == 1)
        (sid,) = _standbys(fake)
        fake.fail("exec_stream", pandastack.ServerError("upstream hiccup"), match="kill -0", times=3)
        _until(lambda: not any(f.op == "exec_stream" for f in fake._failures))  # all three were hit
        assert pool.waiting() == [sid] and sid in fake.live()  # unknown is not dead
