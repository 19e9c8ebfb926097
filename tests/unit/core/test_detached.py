"""Detached jobs (deferrable operators, async pollers): launch, poll one marker, finish."""

from __future__ import annotations

import time

import pandastack
import pytest

from pandastack_jobs import (
    DetachedJob,
    FailureKind,
    JobSpec,
    SandboxGone,
    finish_detached,
    guest,
    poll_detached,
    start_detached,
)
from pandastack_jobs.testing import FakeClient


def _start(fake: FakeClient, spec: JobSpec) -> DetachedJob:
    job = start_detached(fake, spec)
    assert isinstance(job, DetachedJob), job
    return job


def test_the_job_runs_in_the_background_until_its_marker_appears(fake: FakeClient) -> None:
    fake.script("etl", runs_for=2, result={"ok": 1}, stdout="out\n", stderr="warn\n")
    spec = JobSpec(command="etl", timeout=60)
    job = _start(fake, spec)
    call = fake.execs[-1]
    assert call.detached and not call.stream and call.command == "etl"
    assert fake.live() == [job.sandbox_id]  # kept running between polls
    assert [poll_detached(fake, job.sandbox_id) for _ in range(3)] == [None, None, 0]
    chunks: list[tuple[str, str]] = []
    outcome = finish_detached(fake, spec, job, on_output=lambda s, c: chunks.append((s, c)))
    assert outcome.ok and outcome.result == {"ok": 1}
    assert chunks == [("stdout", "out\n"), ("stderr", "warn\n")]
    assert fake.live() == []


def test_a_failed_exit_is_classified_like_a_foreground_job(fake: FakeClient) -> None:
    fake.script("etl", exit_code=4, stderr="bad input\n")
    spec = JobSpec(command="etl", permanent_exit_codes=[4])
    job = _start(fake, spec)
    assert poll_detached(fake, job.sandbox_id) == 4
    outcome = finish_detached(fake, spec, job)
    assert outcome.kind is FailureKind.PERMANENT_EXIT_CODE and "bad input" in outcome.reason


def test_a_launch_that_fails_returns_the_failure_and_leaves_nothing(fake: FakeClient) -> None:
    fake.fail("exec", pandastack.ServerError("agent unreachable"))
    outcome = start_detached(fake, JobSpec(command="etl"))
    assert not isinstance(outcome, DetachedJob)
    assert outcome.kind is FailureKind.SERVER_ERROR and fake.live() == []


def test_a_vanished_sandbox_raises_sandbox_gone_and_finishes_as_lost(fake: FakeClient) -> None:
    fake.script("etl", runs_for=5)
    spec = JobSpec(command="etl")
    job = _start(fake, spec)
    fake.expire(job.sandbox_id)
    with pytest.raises(SandboxGone):
        poll_detached(fake, job.sandbox_id)
    outcome = finish_detached(fake, spec, job)
    assert outcome.kind is FailureKind.SANDBOX_LOST and outcome.redeliver


def test_past_the_deadline_without_a_marker_is_a_timeout(fake: FakeClient) -> None:
    fake.script("etl", hangs=True)
    spec = JobSpec(command="etl", timeout=1)
    started = _start(fake, spec)
    job = DetachedJob(started.sandbox_id, started_at=time.time() - 3600, timeout=1)
    assert poll_detached(fake, job.sandbox_id) is None
    outcome = finish_detached(fake, spec, job)
    assert outcome.kind is FailureKind.TIMEOUT and fake.live() == []


def test_a_half_written_marker_reads_as_still_running(fake: FakeClient) -> None:
    fake.script("etl", runs_for=100)
    job = _start(fake, JobSpec(command="etl"))
    fake.sandbox(job.sandbox_id).files[guest.DETACHED_EXIT] = b""
    assert poll_detached(fake, job.sandbox_id) is None


def test_the_handle_survives_a_round_trip_through_json(fake: FakeClient) -> None:
    job = _start(fake, JobSpec(command="etl", timeout=12))
    again = DetachedJob.from_dict(job.to_dict())
    assert again == job and again.deadline == job.started_at + 12 + guest.KILL_GRACE_SECONDS + 30
