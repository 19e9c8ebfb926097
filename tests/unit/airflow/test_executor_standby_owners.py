"""Who owns a standby, as the executor's orphan sweep decides it from Airflow's metadata DB.

A standby names the scheduler job its executor runs in (id and start); the sweep calls that
owner gone once the job's row says so (ended, or silent past Airflow's health threshold and a
floor), alive while it heartbeats, and unknown when the row is missing or started at another
time (another deployment's job with the same id): only a gone owner's idle standbys are deleted
(the driver's side: test_executor_warm.py). Only the ``job`` table is made here (no migration).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from airflow_provider.executors.driver import PandaStackDriver
from airflow_provider.executors.orphans import (
    OWNER_JOB,
    OWNER_SILENCE_SECONDS,
    OWNER_STARTED,
    owners_alive,
    scheduler_owner,
)


@pytest.fixture
def job() -> Iterator[Callable[..., Any]]:
    """Scheduler job rows: ``job(state, silent_for)`` -> the row (its heartbeat that many seconds old)."""
    from airflow import settings
    from airflow.jobs.job import Job, JobState
    from airflow.utils.session import create_session

    Job.__table__.create(settings.engine, checkfirst=True)
    made: list[int] = []

    def make(state: str = JobState.RUNNING, silent_for: float = 0.0) -> Any:
        with create_session() as session:
            row = Job(job_type="SchedulerJob")
            row.state = state
            row.latest_heartbeat = datetime.now(timezone.utc) - timedelta(seconds=silent_for)
            session.add(row)
            session.commit()
            session.refresh(row)
            session.expunge(row)
        made.append(row.id)
        return row

    yield make
    with create_session() as session:
        session.query(Job).filter(Job.id.in_(made)).delete(synchronize_session=False)


def test_a_standby_names_its_scheduler_job_by_id_and_start(job: Callable[..., Any]) -> None:
    row = job()
    owner = scheduler_owner(row.id)
    assert owner == {OWNER_JOB: str(row.id), OWNER_STARTED: owner[OWNER_STARTED]}
    assert datetime.fromisoformat(owner[OWNER_STARTED]) == row.start_date
    assert scheduler_owner(None) == {}  # no scheduler job (an executor outside a scheduler)


def test_an_owner_is_gone_only_when_its_job_ended_or_fell_silent(job: Callable[..., Any]) -> None:
    from airflow.jobs.job import JobState

    rows = {
        "beating": job(),
        "silent past Airflow's threshold, within the floor": job(silent_for=OWNER_SILENCE_SECONDS - 15),
        "killed": job(silent_for=OWNER_SILENCE_SECONDS + 60),
        "ended": job(state=JobState.SUCCESS),
        "crashed": job(state=JobState.FAILED),
    }
    metadata = [scheduler_owner(row.id) for row in rows.values()]
    assert dict(zip(rows, owners_alive(metadata), strict=True)) == {
        "beating": True,
        "silent past Airflow's threshold, within the floor": True,
        "killed": False,
        "ended": False,
        "crashed": False,
    }


def test_an_owner_this_db_cannot_vouch_for_is_unknown(job: Callable[..., Any]) -> None:
    from airflow.jobs.job import JobState

    dead = job(state=JobState.SUCCESS)
    started = scheduler_owner(dead.id)[OWNER_STARTED]
    unknown = [
        {},  # made before standbys named their owner
        {OWNER_JOB: str(dead.id), OWNER_STARTED: "2001-01-01T00:00:00+00:00"},  # another DB's job
        {OWNER_JOB: str(dead.id)},
        {OWNER_JOB: "not-a-number", OWNER_STARTED: started},
        {OWNER_JOB: "999999999", OWNER_STARTED: started},  # no such job (or its row cleaned up)
    ]
    assert owners_alive(unknown) == [None] * len(unknown)
    assert owners_alive([]) == []


def test_the_executor_names_its_job_on_its_standbys_and_checks_owners_in_its_db(
    logs: Any, monkeypatch: pytest.MonkeyPatch, job: Callable[..., Any]
) -> None:
    from airflow_provider.executors.pandastack_executor import PandaStackExecutor

    monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__WARM_POOL_SIZE", "1")
    monkeypatch.setenv("AIRFLOW__PANDASTACK_EXECUTOR__CHECK_HEALTH_ON_STARTUP", "False")
    opened: dict[str, Any] = {}

    def open_standbys(self: PandaStackDriver, warms: Any, size: int, **kwargs: Any) -> list[str]:
        opened.update(kwargs)
        return []

    monkeypatch.setattr(PandaStackDriver, "open_standbys", open_standbys)
    row = job()
    executor = PandaStackExecutor()
    executor.job_id = row.id  # the scheduler sets it before start()
    executor.start()
    try:
        assert opened["owner"] == scheduler_owner(row.id) != {}
        assert isinstance(executor.driver, PandaStackDriver) and executor.driver.owners_alive is owners_alive
    finally:
        executor.shutdown_timeout = 2
        executor.end()
