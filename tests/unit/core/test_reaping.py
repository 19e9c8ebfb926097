"""Orphans: what earlier attempts left is deleted before a new one; sweeps by run, job, fork."""

from __future__ import annotations

import logging

import pandastack
import pytest

from pandastack_jobs import (
    JobKey,
    JobSpec,
    WarmPool,
    WarmupFailed,
    delete_sandbox,
    reap_before,
    reap_earlier_attempts,
    run_job,
    sweep_forks,
    sweep_job,
    sweep_managed,
    sweep_run,
)
from pandastack_jobs.testing import FakeClient


def _key(task: str = "t", try_number: int = 3, run: str = "r1") -> JobKey:
    return JobKey(engine="unit", workflow="w", task=task, run=run, try_number=try_number)


def test_earlier_tries_of_the_same_job_are_reaped_and_nothing_else(fake: FakeClient) -> None:
    key = _key(try_number=3)
    earlier = fake.add_sandbox(metadata=_key(try_number=2).metadata())
    unreadable = fake.add_sandbox(metadata={**key.metadata(), "job_try": "x"})
    same_try = fake.add_sandbox(metadata=key.metadata())
    later = fake.add_sandbox(metadata=_key(try_number=4).metadata())
    other_task = fake.add_sandbox(metadata=_key(task="u", try_number=1).metadata())
    stranger = fake.add_sandbox(metadata={})
    assert sorted(reap_earlier_attempts(fake, key)) == sorted([earlier.id, unreadable.id])
    assert sorted(fake.live()) == sorted([same_try.id, later.id, other_task.id, stranger.id])


def test_run_job_reaps_before_it_creates(fake: FakeClient) -> None:
    old = fake.add_sandbox(metadata=_key(try_number=1).metadata())
    fake.script("true", result=1)
    run_job(fake, JobSpec(command="true", key=_key(try_number=2)))
    assert old.id in fake.deleted and fake.deleted.index(old.id) == 0


def test_an_unreachable_server_does_not_stop_the_new_attempt(
    fake: FakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    fake.fail("list", pandastack.ServerError("down"))
    assert reap_before(fake, JobSpec(command="x", key=_key())) == []
    assert "could not look for orphans" in caplog.text


def test_sweeps_by_run_job_fork_and_owner(fake: FakeClient) -> None:
    a1 = fake.add_sandbox(metadata=_key(task="a").metadata())
    a2 = fake.add_sandbox(metadata=_key(task="a", try_number=1).metadata())
    b = fake.add_sandbox(metadata=_key(task="b").metadata())
    other_run = fake.add_sandbox(metadata=_key(task="a", run="r2").metadata())
    child = fake.add_sandbox(metadata={"forked_from": b.id})
    foreign = fake.add_sandbox(metadata={"owner": "someone"})
    assert sorted(sweep_job(fake, _key(task="a"))) == sorted([a1.id, a2.id])
    assert sweep_forks(fake, b.id) == [child.id]
    assert sweep_run(fake, _key()) == [b.id]
    assert sweep_managed(fake) == [other_run.id]
    assert fake.live() == [foreign.id]


def test_delete_is_idempotent_and_reports_other_errors(
    fake: FakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    sb = fake.add_sandbox()
    assert delete_sandbox(fake, sb.id) is True
    assert delete_sandbox(fake, sb.id) is False  # 404: already gone
    other = fake.add_sandbox()
    fake.fail("delete", pandastack.ServerError("busy"), times=None)
    with caplog.at_level(logging.WARNING):
        assert delete_sandbox(fake, other.id) is False
    assert "could not delete sandbox" in caplog.text
    with pytest.raises(pandastack.ServerError):
        delete_sandbox(fake, other.id, raise_errors=True)


# -- warm pools -------------------------------------------------------------------------------


def test_a_pool_forks_each_job_from_a_pristine_parent_and_sets_the_childs_ttl(fake: FakeClient) -> None:
    fake.script("warm", files={"/work/model.bin": b"weights"})
    children: list[tuple[str, int | None, bytes]] = []

    def job(sb: object, call: object) -> None:
        state = fake.sandbox(sb.id)  # type: ignore[attr-defined]
        children.append((state.metadata["forked_from"], state.ttl_seconds, state.files["/work/model.bin"]))
        state.files["/work/model.bin"] = b"scribbled"

    from pandastack_jobs.testing import Script

    fake.script("predict", Script(action=job, result=1))
    with WarmPool(fake, warmup=JobSpec(command="warm", result_path=None)) as pool:
        parent = pool.parent_id
        assert parent is not None and fake.sandbox(parent).metadata["role"] == "warm-parent"
        for _ in range(2):
            assert pool.run(JobSpec(command="predict", timeout=30)).ok
        assert fake.live() == [parent]
        assert fake.sandbox(parent).files["/work/model.bin"] == b"weights"
    assert children == [(parent, 90, b"weights")] * 2
    assert fake.live() == []


def test_a_failed_warmup_deletes_the_parent(fake: FakeClient) -> None:
    fake.script("warm", exit_code=2, stderr="no GPU\n")
    with pytest.raises(WarmupFailed, match="no GPU"):
        WarmPool(fake, warmup=JobSpec(command="warm", result_path=None)).start_parent()
    assert fake.live() == []


def test_a_child_whose_ttl_cannot_be_set_is_deleted(fake: FakeClient) -> None:
    pool = WarmPool(fake, warmup=JobSpec(command="warm", result_path=None))
    parent = pool.start_parent()
    fake.fail("set_ttl", pandastack.ServerError("lifecycle down"))
    outcome = pool.run(JobSpec(command="x"))
    assert not outcome.ok and fake.live() == [parent]
    pool.close()
    assert fake.live() == []


def test_close_sweeps_children_a_crashed_job_left_and_attach_reuses_a_parent(fake: FakeClient) -> None:
    parent = WarmPool(fake, warmup=JobSpec(command="warm", result_path=None)).start_parent()
    fake.add_sandbox(metadata={"forked_from": parent})
    pool = WarmPool.attach(fake, parent)
    assert pool.start_parent() == parent
    pool.close()
    assert fake.live() == []
    pool.close()  # idempotent
