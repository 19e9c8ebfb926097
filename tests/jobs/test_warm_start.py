"""Warm starts against a real pandastack_local server: standbys, the runner, attach and the fallbacks.

The warm module is delivered with the standby (``WarmStart.files``) and records the pid of the
interpreter that imported it, so a job can prove it runs in that interpreter's fork: its parent
is the runner and the module is already in ``sys.modules``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pandastack_jobs import (
    DetachedJob,
    FailureKind,
    JobSpec,
    Standby,
    StandbyPool,
    WarmStart,
    delete_sandbox,
    guest,
    run_job,
    start_detached,
)
from pandastack_jobs.warm_start import PID_PATH, STANDBY_LABEL

pytestmark = pytest.mark.slow

WARM_DIR = "/work/.warm"
ENV = {"PYTHONPATH": WARM_DIR}
WARM = WarmStart(
    template="base",
    modules=("warmmark",),
    env=ENV,
    files={f"{WARM_DIR}/warmmark.py": "import os, time\nRUNNER_PID = os.getpid()\nLOADED_AT = time.time()\n"},
)
PROBE = """
import json, os, sys
mark = sys.modules.get("warmmark")
state = {
    "warm_env": os.environ.get("PANDASTACK_WARM"),
    "preloaded": mark is not None,
    "parent_is_runner": mark is not None and os.getppid() == mark.RUNNER_PID,
    "argv": sys.argv[1:],
    "name": __name__,
}
json.dump(state, open(os.environ["JOB_RESULT"], "w"))
"""
COLD_ARGV = ["python3", "-m", "probe", "a b", "$HOME"]


def _spec(**kw: object) -> JobSpec:
    opts: dict[str, object] = {
        "command": "python3 -m probe 'a b' '$HOME'",
        "files": {"probe.py": PROBE},
        "template": "base",
        "env": ENV,
        "timeout": 60,
    }
    opts.update(kw)
    return JobSpec(**opts)  # type: ignore[arg-type]


def _ready(pool: StandbyPool, n: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while pool.ready < n:
        assert time.monotonic() < deadline, f"pool not ready: {pool.last_error}"
        time.sleep(0.05)


@pytest.fixture
def pool(local_server) -> Iterator[StandbyPool]:
    p = StandbyPool(local_server.client, WARM, size=1, metadata={"suite": "warm"})
    p.start()
    try:
        yield p
    finally:
        p.close()


def _take(pool: StandbyPool) -> Standby:
    _ready(pool, 1)
    standby = pool.take()
    assert standby is not None
    return standby


def _run(client, standby: Standby, spec: JobSpec, argv: list[str] = COLD_ARGV):
    return run_job(client, spec, standby=standby, standby_command=standby.command(argv))


def test_a_job_through_a_standby_runs_in_the_warm_interpreter(pool, ps_client) -> None:
    standby = _take(pool)
    meta = ps_client.sandboxes.get(standby.sandbox_id).metadata
    assert meta[STANDBY_LABEL] == WARM.key() and meta["suite"] == "warm"
    outcome = _run(ps_client, standby, _spec())
    assert outcome.ok, outcome.reason
    assert outcome.sandbox_id == standby.sandbox_id and outcome.standby is True
    assert outcome.result == {
        "warm_env": "1",
        "preloaded": True,
        "parent_is_runner": True,
        "argv": ["a b", "$HOME"],
        "name": "__main__",
    }


def test_the_same_job_cold_has_none_of_the_warmth(ps_client) -> None:
    """The control for the warm test: the probe tells a warm run from a cold one."""
    outcome = run_job(ps_client, _spec())
    assert outcome.ok, outcome.reason
    assert outcome.result["warm_env"] is None and outcome.result["preloaded"] is False
    assert outcome.result["argv"] == ["a b", "$HOME"]


EXITS = """
import os, signal, sys
print("to stdout", os.environ["JOB_COLOUR"], os.environ.get("PANDASTACK_WARM"), flush=True)
print("to stderr", file=sys.stderr, flush=True)
how = sys.argv[1]
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "raise":
    raise RuntimeError("boom from the job")
sys.exit(int(how))
"""


@pytest.mark.parametrize(
    ("how", "code", "in_stderr"),
    [("3", 3, "to stderr"), ("kill", 137, "to stderr"), ("raise", 1, "RuntimeError: boom from the job")],
)
def test_exit_codes_output_and_env_pass_through(pool, ps_client, how, code, in_stderr) -> None:
    standby = _take(pool)
    spec = _spec(
        command=f"python3 -m exits {how}",
        files={"exits.py": EXITS},
        env={**ENV, "JOB_COLOUR": "teal"},
        result_path=None,
    )
    outcome = _run(ps_client, standby, spec, ["python3", "-m", "exits", how])
    assert not outcome.ok and outcome.exit_code == code, outcome.reason
    assert outcome.kind is FailureKind.EXIT_CODE
    assert "to stdout teal 1" in outcome.stdout_tail  # the job's env, and it ran warm
    assert in_stderr in outcome.stderr_tail
    assert "warm_runner" not in outcome.stderr_tail  # the runner's frames are not the job's


HANGS = """
import signal, subprocess, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)   # deaf to TERM: only the KILL ends it
subprocess.Popen(["sleep", "303"])                # a child in the job's process group
print("started", flush=True)
time.sleep(300)
"""
JOB_PROCESSES = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done"


def _job_processes(sb, pattern: str, wait: float) -> list[str]:
    """The sandbox's processes whose command line has ``pattern``, once none are left or ``wait`` passed."""
    deadline = time.monotonic() + wait
    while True:
        procs = sb.exec(JOB_PROCESSES, timeout_seconds=20).stdout
        left = [line for line in procs.splitlines() if pattern in line]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _time_out_warm(pool, ps_client, module: str, code: str, look: Callable[[Any, float], list[str]]) -> None:
    """Run ``module`` (``code``) warm in a standby with a 2 s timeout: it times out, and ``look``
    (the sandbox, the exec's seconds) finds none of its processes left."""
    from pandastack_jobs.lifecycle import JobRun

    standby = _take(pool)
    spec = _spec(command=f"python3 -m {module}", files={f"{module}.py": code}, timeout=2, result_path=None)
    left: list[str] = ["not looked"]
    run = JobRun(ps_client, spec)

    def execute_then_look(sb):
        exit_code, elapsed = run.execute(sb)
        left[:] = look(sb, elapsed)
        return exit_code, elapsed

    outcome = run.run(
        acquire=lambda: run.take_standby(standby.sandbox_id, standby.command(["python3", "-m", module])),
        execute=execute_then_look,
        fresh=True,
    )
    assert run.warm is True and "started" in outcome.stdout_tail
    assert outcome.kind is FailureKind.TIMEOUT, outcome.reason
    assert left == []


def test_the_guest_timeout_kills_the_jobs_whole_process_group(pool, ps_client) -> None:
    """A job deaf to TERM, with a child: the timeout's TERM is passed on, the KILL follows."""

    def look(sb, elapsed: float) -> list[str]:
        # The TERM alone did not end it: the exec returned only once the KILL had (the grace).
        assert elapsed >= 2 + guest.KILL_GRACE_SECONDS - 0.5, elapsed
        return _job_processes(sb, "hangs", 15) + _job_processes(sb, "sleep 303", 1)

    _time_out_warm(pool, ps_client, "hangs", HANGS, look)


DIES_AT_TERM = """
import subprocess, time
subprocess.Popen(["sh", "-c", "trap '' TERM; exec sleep 305"])  # deaf to TERM; the job itself is not
print("started", flush=True)
time.sleep(300)
"""


def test_a_warm_job_that_dies_at_term_leaves_no_child_deaf_to_it(pool, ps_client) -> None:
    """The runner reports the job's exit at the TERM; what ignored the TERM is KILLed after the grace."""
    _time_out_warm(
        pool, ps_client, "diesatterm", DIES_AT_TERM, lambda sb, elapsed: _job_processes(sb, "sleep 305", 0)
    )


SLEEPS = """
import subprocess, time
subprocess.Popen(["sleep", "304"])
time.sleep(300)
"""


def test_an_attach_killed_outright_takes_the_job_with_it(pool, ps_client) -> None:
    """The runner SIGKILLs the job's process group when its attach goes away (detached job)."""
    standby = _take(pool)
    spec = _spec(command="python3 -m sleeps", files={"sleeps.py": SLEEPS}, timeout=120, result_path=None)
    job = start_detached(
        ps_client, spec, standby=standby, standby_command=standby.command(["python3", "-m", "sleeps"])
    )
    try:
        assert isinstance(job, DetachedJob) and job.sandbox_id == standby.sandbox_id
        sb = ps_client.sandboxes.get(job.sandbox_id)
        deadline = time.monotonic() + 10
        while not _job_processes(sb, "sleep 304", 0):
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.1)
        kill_attach = (
            "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null | grep -q '^python3 -I -S' "
            "&& kill -9 ${p#/proc/}; done; true"
        )
        assert sb.exec(kill_attach, timeout_seconds=20).exit_code == 0
        assert _job_processes(sb, "sleep 304", 10) == []
        assert _job_processes(sb, "sleeps", 1) == []
    finally:
        delete_sandbox(ps_client, standby.sandbox_id)


def test_a_killed_runner_leaves_the_job_to_run_cold_in_the_same_sandbox(pool, ps_client) -> None:
    standby = _take(pool)
    sb = ps_client.sandboxes.get(standby.sandbox_id)
    assert sb.exec(f"kill -9 $(cat {PID_PATH})", timeout_seconds=20).exit_code == 0
    outcome = _run(ps_client, standby, _spec())
    assert outcome.ok, outcome.reason
    assert outcome.sandbox_id == standby.sandbox_id
    assert outcome.result["warm_env"] is None and outcome.result["preloaded"] is False
    assert outcome.result["argv"] == ["a b", "$HOME"]


def test_a_standby_deleted_before_take_falls_back_to_a_fresh_cold_sandbox(pool, ps_client) -> None:
    standby = _take(pool)
    ps_client.sandboxes.delete(standby.sandbox_id)
    created: list[str] = []
    outcome = run_job(
        ps_client,
        _spec(),
        standby=standby,
        standby_command=standby.command(COLD_ARGV),
        on_created=created.append,
    )
    assert outcome.ok, outcome.reason
    assert created and created[0] != standby.sandbox_id and outcome.sandbox_id == created[0]
    assert outcome.standby is False
    assert outcome.result["preloaded"] is False and outcome.result["argv"] == ["a b", "$HOME"]


WRITES = """
import json, os
seen = os.path.exists("/work/from-job-1") or os.path.exists("/tmp/from-job-1")
if os.environ["WHICH"] == "1":
    open("/work/from-job-1", "w").write("x")
    open("/tmp/from-job-1", "w").write("x")
json.dump({"seen": seen, "warm": os.environ.get("PANDASTACK_WARM")}, open(os.environ["JOB_RESULT"], "w"))
"""


def test_two_standbys_are_separate_sandboxes(local_server, ps_client) -> None:
    with StandbyPool(local_server.client, WARM, size=2, fill_concurrency=2) as pool:
        _ready(pool, 2)
        first, second = pool.take(), pool.take()
        assert first is not None and second is not None
        assert first.sandbox_id != second.sandbox_id
        argv = ["python3", "-m", "writes"]
        outcomes = [
            _run(
                ps_client,
                sb,
                _spec(command="python3 -m writes", files={"writes.py": WRITES}, env={**ENV, "WHICH": n}),
                argv,
            )
            for sb, n in ((first, "1"), (second, "2"))
        ]
    assert [o.result for o in outcomes] == [{"seen": False, "warm": "1"}, {"seen": False, "warm": "1"}]


def test_close_deletes_the_untaken_standbys(local_server, ps_client) -> None:
    pool = StandbyPool(local_server.client, WARM, size=2, fill_concurrency=2).start()
    _ready(pool, 2)
    waiting = set(pool.waiting())
    assert waiting <= {sb.id for sb in ps_client.sandboxes.list()} and len(waiting) == 2
    pool.close()
    assert ps_client.sandboxes.list() == []
    assert pool.take() is None


@pytest.mark.parametrize(
    ("warm", "error"),
    [
        (WarmStart(template="base", modules=("no_such_module_xyz",)), "No module named 'no_such_module_xyz'"),
        (WarmStart(template="base", python="/nonexistent/python3"), "runner exited 127"),
    ],
)
def test_a_standby_whose_runner_cannot_start_is_deleted_and_reported(
    local_server, ps_client, warm: WarmStart, error: str
) -> None:
    pool = StandbyPool(local_server.client, warm, size=1).start()
    try:
        deadline = time.monotonic() + 60
        while pool.failures < 1:
            assert time.monotonic() < deadline, "the failure was never reported"
            time.sleep(0.05)
        assert pool.ready == 0 and pool.last_error is not None and error in pool.last_error
    finally:
        pool.close()
    assert ps_client.sandboxes.list() == []


PKG_MAIN = """
import json, os, sys
if __name__ == "__main__":
    state = {"warm": os.environ.get("PANDASTACK_WARM"), "name": __name__}
    json.dump(state, open(os.environ["JOB_RESULT"], "w"))
"""


def test_running_a_preloaded_submodule_prints_no_runpy_warning(local_server, ps_client) -> None:
    """The engine's entry point is often the very module the standby preloaded (``prefect.engine``):
    runpy then warns that it is already in ``sys.modules``; the runner keeps that out of the job's stderr."""
    warm = WarmStart(
        template="base",
        modules=("warmpkg.main",),
        env=ENV,
        files={f"{WARM_DIR}/warmpkg/__init__.py": "", f"{WARM_DIR}/warmpkg/main.py": PKG_MAIN},
    )
    with StandbyPool(local_server.client, warm, size=1) as p:
        standby = _take(p)
        argv = ["python3", "-m", "warmpkg.main"]
        outcome = run_job(
            ps_client,
            _spec(command="python3 -m warmpkg.main", files={}),
            standby=standby,
            standby_command=standby.command(argv),
        )
    assert outcome.ok, outcome.reason
    assert outcome.result == {"warm": "1", "name": "__main__"}
    assert "found in sys.modules" not in outcome.stderr_tail
