"""The guest-side clock ends the job's whole process group, not only the shell that runs it.

``timeout`` sends TERM to its child and its process group; the ``sh -c`` wrapper dies at the TERM,
so ``timeout`` sees its child exit and never sends the KILL after the grace. A process of the job
that ignores TERM would outlive its clock in a sandbox that outlives the job (a queue chunk's next
mate, a warm pool's sandbox, a detached job until it is polled, ``keep_on_success``). Each path's
line is run in a real sandbox, with a child deaf to TERM, and the sandbox's processes are read.
"""

from __future__ import annotations

import time

import pandastack

from pandastack_jobs import FailureKind, JobSpec, guest
from pandastack_jobs.lifecycle import JobRun
from pandastack_jobs.reaper import delete_sandbox

# The job's own shell is killed by the TERM; its background child ignores it (SIG_IGN survives exec).
DEAF = "(trap '' TERM; exec sleep 1001) & sleep 600"
MARK = "sleep 1001"
PROCESSES = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done"
TIMEOUT = 2


def _left(sb: pandastack.Sandbox) -> list[str]:
    procs = sb.exec(PROCESSES, timeout_seconds=20).stdout
    return [line for line in procs.splitlines() if MARK in line]


def _sandbox(client: pandastack.Client) -> pandastack.Sandbox:
    return client.sandboxes.create(template="base", ttl_seconds=120)


def test_a_run_job_exec_leaves_nothing_of_a_job_deaf_to_term(ps_client: pandastack.Client) -> None:
    """The fresh sandbox's one exec (job_script): exit 124, then nothing of the job is left."""
    spec = JobSpec(command=DEAF, timeout=TIMEOUT)
    run = JobRun(ps_client, spec)
    left: list[str] = ["not looked"]

    def execute_then_look(sb: pandastack.Sandbox) -> tuple[int, float]:
        code, elapsed = run.execute(sb)
        left[:] = _left(sb)
        return code, elapsed

    outcome = run.run(execute=execute_then_look)
    assert outcome.kind is FailureKind.TIMEOUT, outcome.reason
    assert outcome.exit_code == guest.TIMEOUT_EXIT_CODE
    assert left == []


def test_the_foreground_line_kills_what_ignores_term_after_the_grace(ps_client: pandastack.Client) -> None:
    sb = _sandbox(ps_client)
    try:
        line = guest.foreground_command(DEAF, TIMEOUT, {})
        started = time.monotonic()
        res = sb.exec(line, timeout_seconds=guest.server_timeout(TIMEOUT))
        elapsed = time.monotonic() - started
        assert res.exit_code == guest.TIMEOUT_EXIT_CODE, res.stderr
        assert _left(sb) == []
        assert elapsed < TIMEOUT + guest.KILL_GRACE_SECONDS + 3
    finally:
        delete_sandbox(ps_client, sb.id)


def test_a_job_that_dies_at_term_is_not_kept_for_the_grace(ps_client: pandastack.Client) -> None:
    """The grace is waited for only when something of the job survived the TERM."""
    sb = _sandbox(ps_client)
    try:
        line = guest.foreground_command("sleep 600 & sleep 601", TIMEOUT, {})
        started = time.monotonic()
        res = sb.exec(line, timeout_seconds=guest.server_timeout(TIMEOUT))
        elapsed = time.monotonic() - started
        assert res.exit_code == guest.TIMEOUT_EXIT_CODE, res.stderr
        assert elapsed < TIMEOUT + guest.KILL_GRACE_SECONDS - 2, f"{elapsed:.1f} s"
    finally:
        delete_sandbox(ps_client, sb.id)


def test_a_detached_job_deaf_to_term_is_killed_before_its_exit_marker(ps_client: pandastack.Client) -> None:
    sb = _sandbox(ps_client)
    try:
        assert sb.exec(guest.detached_command(DEAF, TIMEOUT, {}), timeout_seconds=20).exit_code == 0
        deadline = time.monotonic() + TIMEOUT + guest.KILL_GRACE_SECONDS + 10
        while True:
            res = sb.exec(f"cat {guest.DETACHED_EXIT} 2>/dev/null", timeout_seconds=20)
            if res.stdout.strip():
                break
            assert time.monotonic() < deadline, "the detached job never wrote its exit"
            time.sleep(0.2)
        assert int(res.stdout) == guest.TIMEOUT_EXIT_CODE
        assert _left(sb) == []
    finally:
        delete_sandbox(ps_client, sb.id)
