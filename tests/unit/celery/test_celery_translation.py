"""The Celery adapter's translation, against Celery's in-memory broker and the core's FakeClient:
the key, the refusals (pickle, non-JSON, bind), the outcome mapped onto Celery (result, retry with
countdown, failure at once), the time limits onto the guest clock, and what a redelivery reaps."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Retry

from pandastack_celery import SandboxJobFailed, SandboxTask, SandboxTaskConfigError, guest_clock, sandbox_task
from pandastack_jobs import Engine, FailureClass, FailureKind, JobKey, JobOutcome
from pandastack_jobs.connection import _record_refusal
from pandastack_jobs.exceptions import JobArgumentsError, JobSpecError
from pandastack_jobs.pyfunc import COMMAND
from pandastack_jobs.testing import FakeClient


@pytest.fixture
def app() -> Celery:
    app = Celery("unit", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.finalize()  # tasks declared after this are the task objects, not lazy proxies
    return app


def add(x: int, y: int) -> int:
    return x + y


@pytest.fixture
def fake() -> FakeClient:
    """Records the capacity refusal's Retry-After as a client of the core does."""
    return FakeClient(on_create_retry=_record_refusal, max_create_retry_seconds=30)


@pytest.fixture
def task(app: Celery, fake: FakeClient, monkeypatch: pytest.MonkeyPatch) -> Any:
    t = sandbox_task(app, template="base", timeout=60, shared=False)(add)
    monkeypatch.setattr(type(t), "sandbox_client", lambda self: fake)
    return t


def run_as_worker(task: Any, *args: Any, **request: Any) -> Any:
    """Call the task as a worker does: with a request pushed (not called directly)."""
    request = {"id": "tid-1", "retries": 0, "called_directly": False, "delivery_info": {}, **request}
    task.push_request(**request)
    try:
        return task(*args)
    finally:
        task.pop_request()


def test_the_function_runs_in_a_sandbox_and_its_json_result_is_returned(task: Any, fake: FakeClient) -> None:
    fake.script(COMMAND, result=5)
    assert run_as_worker(task, 2, 3) == 5
    assert fake.live() == []
    (call,) = fake.execs
    assert call.env["CELERY_TASK_ID"] == "tid-1" and call.env["CELERY_RETRIES"] == "0"


def test_the_key_names_the_task_id_and_the_retry(task: Any) -> None:
    task.push_request(id="abc", retries=2, called_directly=False)
    try:
        spec, limit = task.job_spec((1, 2), {}, task.request)
    finally:
        task.pop_request()
    assert spec.key == JobKey(engine=Engine.CELERY, workflow="unit", task=task.name, run="abc", try_number=3)
    assert spec.metadata["celery_task_id"] == "abc" and spec.env["CELERY_RETRIES"] == "2"
    assert spec.template == "base" and spec.timeout == 60 and limit is None


def test_a_redelivery_reaps_its_own_tries_sandbox_a_first_delivery_does_not(
    task: Any, fake: FakeClient
) -> None:
    fake.script(COMMAND, result=5)
    task.push_request(id="k", retries=0, called_directly=False)
    key = task.job_spec((1, 2), {}, task.request)[0].key
    task.pop_request()
    orphan = fake.add_sandbox(metadata=key.metadata())
    run_as_worker(task, 1, 2, id="k")  # not marked redelivered: a live duplicate is left alone
    assert fake.live() == [orphan.id]
    run_as_worker(task, 1, 2, id="k", delivery_info={"redelivered": True})
    assert fake.live() == []


def test_a_redeliverable_failure_is_celerys_retry_with_the_retry_after(
    task: Any, fake: FakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    def retry(**kw: Any) -> Retry:
        seen.update(kw)
        return Retry("retry", when=kw["countdown"])

    monkeypatch.setattr(task, "retry", retry)
    fake.refuse_capacity(retry_after=7.0)
    with pytest.raises(Retry):
        run_as_worker(task, 1, 2)
    assert seen["countdown"] >= 7.0
    assert isinstance(seen["exc"], SandboxJobFailed) and seen["exc"].kind is FailureKind.CAPACITY
    fake.script(COMMAND, exit_code=1, stderr="boom")
    with pytest.raises(Retry):
        run_as_worker(task, 1, 2)
    assert seen["countdown"] == task.default_retry_delay


def test_a_dead_letter_fails_at_once_with_the_reason(task: Any, fake: FakeClient, monkeypatch: Any) -> None:
    monkeypatch.setattr(task, "retry", lambda **kw: pytest.fail("a dead-letter must not retry"))
    fake.script(COMMAND, raw_result=b"{not json")
    with pytest.raises(SandboxJobFailed) as failed:
        run_as_worker(task, 1, 2)
    assert failed.value.failure_class is FailureClass.DEAD_LETTER
    assert "not valid JSON" in str(failed.value)
    # JSON-safe: Celery's JSON result backend stores its args and rebuilds it from them.
    rebuilt = SandboxJobFailed(*failed.value.args)
    assert rebuilt.kind is FailureKind.RESULT_INVALID and str(rebuilt) == str(failed.value)


def test_time_limits_become_the_guest_clock() -> None:
    assert guest_clock(300, None, None) == (300, None)
    assert guest_clock(300, 60, 120) == (54.0, 60)  # 10% margin before the soft limit
    assert guest_clock(300, None, 10) == (8.0, 10)  # at least 2 s
    assert guest_clock(5, 60, None) == (5, None)  # the job's own timeout is shorter: it rules
    with pytest.raises(SandboxTaskConfigError, match="time limit of at least"):
        guest_clock(300, 2.5, None)


def test_a_job_stopped_by_the_time_limit_fails_without_retry(
    app: Celery, fake: FakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = sandbox_task(app, soft_time_limit=5, template="base", shared=False)(add)
    monkeypatch.setattr(type(t), "sandbox_client", lambda self: fake)
    monkeypatch.setattr(t, "retry", lambda **kw: pytest.fail("Celery does not retry a timed-out task"))
    fake.script(COMMAND, hangs=True)
    with pytest.raises(SandboxJobFailed, match=r"time limit \(5s") as failed:
        run_as_worker(t, 1, 2, timelimit=(None, None))
    assert failed.value.kind is FailureKind.TIMEOUT


def test_pickle_is_refused_naming_the_setting(app: Celery, task: Any) -> None:
    with pytest.raises(SandboxTaskConfigError, match="serializer='pickle'"):
        sandbox_task(app, serializer="pickle", shared=False)(add)
    with pytest.raises(SandboxTaskConfigError, match=r"serializer='pickle'.*set serializer='json'"):
        task.apply_async((1, 2), serializer="pickle")
    picky = app.task(base=SandboxTask, serializer="pickle", name="picky", shared=False)(add)
    with pytest.raises(SandboxTaskConfigError, match="serializer='pickle'"):
        picky.delay(1, 2)
    app.conf.result_serializer = "pickle"
    with pytest.raises(SandboxTaskConfigError, match="result_serializer='pickle'"):
        run_as_worker(task, 1, 2)


def test_arguments_that_are_not_json_are_refused_before_sending(task: Any) -> None:
    with pytest.raises(JobArgumentsError, match=r"args\[1\]"):
        task.delay(1, {1, 2})
    with pytest.raises(JobArgumentsError, match=r"kwargs\['y'\]"):
        task.apply_async((1,), {"y": object()})


def test_bound_tasks_and_bad_options_are_refused_at_declaration(app: Celery) -> None:
    with pytest.raises(SandboxTaskConfigError, match="drop bind"):
        sandbox_task(app, bind=True, shared=False)(add)
    with pytest.raises(JobSpecError, match="timeout"):
        sandbox_task(app, timeout=-1, shared=False)(add)

    def uses_self(self: Any, x: int) -> int:
        return x

    bound = app.task(base=SandboxTask, bind=True, name="bound", shared=False)(uses_self)
    with pytest.raises(SandboxTaskConfigError, match="drop bind=True"):
        bound.function()


def test_acks_late_and_reject_on_worker_lost_are_on(task: Any) -> None:
    assert task.acks_late and task.reject_on_worker_lost
    assert task.serializer == "json"


def test_a_successful_outcome_is_returned_as_is(task: Any) -> None:
    task.push_request(id="x", called_directly=False)
    try:
        assert task.settle(JobOutcome(ok=True, result={"a": 1}, has_result=True)) == {"a": 1}
    finally:
        task.pop_request()


def test_an_older_celery_is_refused_naming_the_floor() -> None:
    from pandastack_celery.versions import check_celery

    check_celery((5, 4))
    check_celery((6, 0))  # no cap
    with pytest.raises(ImportError, match=r"celery>=5\.4; this is Celery 5\.3"):
        check_celery((5, 3))


class WorkerDied(BaseException):
    """Stands for the pool process dying mid-delivery (nothing after it runs, nothing is settled)."""


def test_past_max_deliveries_a_try_fails_as_a_dead_letter_without_a_sandbox(
    task: Any, fake: FakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each delivery is counted in the result backend before the sandbox starts; deliveries of one
    try past ``max_deliveries`` fail at once; a retry (the next try) counts from 1 again."""
    monkeypatch.setattr(task, "max_deliveries", 2)
    monkeypatch.setattr(task, "retry", lambda **kw: pytest.fail("over the cap must not retry"))

    def dies(self: Any) -> Any:
        raise WorkerDied

    with monkeypatch.context() as m:
        m.setattr(type(task), "sandbox_client", dies)
        for _ in range(2):
            with pytest.raises(WorkerDied):
                run_as_worker(task, 1, 2, id="loops")
    with pytest.raises(SandboxJobFailed) as failed:
        run_as_worker(task, 1, 2, id="loops", delivery_info={"redelivered": True})
    assert failed.value.failure_class is FailureClass.DEAD_LETTER and failed.value.kind is None
    assert "delivered 3 times without a result, over max_deliveries=2" in str(failed.value)
    assert fake.sandbox_state == {} and fake.execs == []  # no sandbox for a capped delivery
    rebuilt = SandboxJobFailed(*failed.value.args)  # JSON-safe, as the result backend stores it
    assert rebuilt.failure_class is FailureClass.DEAD_LETTER and str(rebuilt) == str(failed.value)
    fake.script(COMMAND, result=3)
    assert run_as_worker(task, 1, 2, id="loops", retries=1) == 3  # the next try: delivery 1


def test_a_backend_that_cannot_count_leaves_deliveries_uncapped(fake: FakeClient) -> None:
    app = Celery("unit", broker="memory://", backend="rpc://", set_as_current=False)
    app.finalize()
    t = sandbox_task(app, template="base", timeout=60, shared=False, max_deliveries=1)(add)
    t.push_request(id="x", retries=0, called_directly=False)
    try:
        assert t.count_delivery(t.request) is None
    finally:
        t.pop_request()
