"""The Airflow adapter only translates: a task try → the core's job, the outcome → XCom or the
right exception. Checked through :class:`FakeClient`, with a stand-in task instance (no DB).

The same operator against real sandboxes and a real ``dag.test`` is tests/airflow.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from pandastack_jobs.testing import FakeClient
from tests.unit.airflow.tis import TI, Store, context


def operator(**kwargs: Any) -> Any:
    from airflow_provider.operators.sandbox import PandaStackSandboxOperator

    return PandaStackSandboxOperator(task_id="t", **{"command": "python3 job.py", **kwargs})


def test_success_returns_the_result_and_pushes_the_summary(wired: FakeClient) -> None:
    wired.script("python3 job.py", result={"n": 1}, files={"/work/out.txt": "hi"})
    ctx = context(TI(try_number=2))
    assert operator(collect=["out.txt"]).execute(ctx) == {"n": 1}
    xcom = ctx["ti"].xcom
    assert xcom["pandastack"]["ok"] and xcom["pandastack"]["try_number"] == 2
    assert xcom["sandbox_id"] == xcom["pandastack"]["sandbox_id"]
    assert xcom["files"] == {"/work/out.txt": {"size": 2, "text": "hi"}}
    assert set(xcom["timings"]) >= {"create", "exec", "delete"}
    assert ctx["task_state_store"] == {} and wired.live() == []


def test_the_try_is_the_jobs_key_on_the_sandbox(wired: FakeClient) -> None:
    seen: list[dict[str, str]] = []
    from pandastack_jobs.testing import Script

    wired.script(
        "python3 job.py", Script(action=lambda sb, c: seen.append(dict(sb.metadata)) and None, result=1)
    )
    operator().execute(context(TI(try_number=3, map_index=4)))
    meta = seen[0]
    assert (meta["job_engine"], meta["job_workflow"], meta["job_task"], meta["job_run"]) == (
        "airflow",
        "d",
        "t",
        "manual__1",
    )
    assert (meta["job_try"], meta["job_map_index"]) == ("3", "4")


def test_a_sandbox_recorded_by_an_earlier_try_is_deleted_first(wired: FakeClient) -> None:
    old = wired.add_sandbox()
    store = Store(pandastack_sandbox_id=old.id)
    wired.script("python3 job.py", result=1)
    operator().execute(context(store=store))
    assert wired.deleted[0] == old.id and store == {}


def test_redeliver_raises_a_retryable_error_with_retry_after(wired: FakeClient) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider.exceptions import PandaStackJobRedeliver

    wired.refuse_capacity(retry_after=None)
    with pytest.raises(PandaStackJobRedeliver) as caught:
        operator().execute(context())
    assert caught.value.kind == "capacity" and caught.value.retry_after == 5.0
    assert not isinstance(caught.value, AirflowFailException)


def test_dead_letter_fails_at_once(wired: FakeClient) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider.exceptions import PandaStackJobDeadLetter

    wired.script("python3 job.py", exit_code=3, stderr="bad row\n")
    with pytest.raises(PandaStackJobDeadLetter) as caught:
        operator(permanent_exit_codes=[3]).execute(context())
    assert isinstance(caught.value, AirflowFailException) and "bad row" in str(caught.value)
    assert caught.value.summary["class"] == "dead_letter"


def test_rendered_text_options_are_read_back_and_bad_ones_fail_naming_the_field(wired: FakeClient) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    wired.script("python3 job.py", result=1)
    op = operator(env="{{ params.env }}", timeout="{{ params.t }}")
    op.env, op.timeout = '{"N": 3}', "30"  # as Jinja renders them: text
    op.execute(context())
    assert wired.execs[-1].env["N"] == "3" and wired.execs[-1].timeout == 30
    op.timeout = "soon"
    with pytest.raises(AirflowFailException, match="timeout"):
        op.execute(context())


def test_a_plain_bad_option_fails_the_dag_import() -> None:
    with pytest.raises(ValueError, match="ttl"):
        operator(timeout=100, ttl=10)


def test_on_kill_deletes_the_sandbox_and_the_task_fails(wired: FakeClient) -> None:
    import threading

    from airflow.sdk.exceptions import AirflowFailException

    release = threading.Event()
    wired.script("python3 job.py", wait=release)
    op = operator()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            op.execute(context())
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    try:
        while not wired.execs:
            threading.Event().wait(0.002)
        op.on_kill()
        worker.join(5)
    finally:
        release.set()  # an on_kill that did not stop the job must not hang the run
    assert errors, "the task did not end when killed"
    assert isinstance(errors[0], AirflowFailException) and wired.live() == []


def test_deferrable_defers_with_the_job_and_finishes_from_the_event(wired: FakeClient) -> None:
    from airflow.sdk.exceptions import TaskDeferred

    wired.script("python3 job.py", result={"late": True}, runs_for=1)
    op = operator(deferrable=True, poll_interval=0.001)
    ctx = context()
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(ctx)
    trigger = deferred.value.trigger
    sandbox_id = trigger.job["sandbox_id"]
    assert wired.live() == [sandbox_id]

    async def first_event() -> Any:
        async for event in trigger.run():
            return event.payload

    payload = asyncio.run(first_event())
    assert payload["status"] == "exited" and payload["exit_code"] == 0
    assert op.execute_complete(ctx, payload) == {"late": True}
    assert wired.live() == []


def test_the_retry_policy_waits_at_least_the_servers_retry_after() -> None:
    from airflow_provider.exceptions import PandaStackJobDeadLetter, PandaStackJobRedeliver
    from airflow_provider.retries import pandastack_retry_policy
    from pandastack_jobs import FailureClass, FailureKind, JobOutcome

    def outcome(kind: FailureKind, cls: FailureClass, retry_after: float | None = None) -> JobOutcome:
        return JobOutcome(ok=False, kind=kind, failure_class=cls, reason="r", retry_after=retry_after)

    from airflow.sdk.definitions.retry_policy import RetryAction

    capacity = PandaStackJobRedeliver(outcome(FailureKind.CAPACITY, FailureClass.REDELIVER, 30))
    decision = pandastack_retry_policy.evaluate(capacity, 1, 3, {"task": type("T", (), {"retry_delay": 5})()})
    assert decision.action is RetryAction.RETRY and decision.retry_delay == timedelta(seconds=30)
    longer = pandastack_retry_policy.evaluate(capacity, 1, 3, {"task": type("T", (), {"retry_delay": 60})()})
    assert longer.action is RetryAction.RETRY and longer.retry_delay is None  # the task's longer delay stands
    dead = PandaStackJobDeadLetter(outcome(FailureKind.AUTH, FailureClass.DEAD_LETTER))
    assert pandastack_retry_policy.evaluate(dead, 1, 3).action is RetryAction.FAIL
    assert pandastack_retry_policy.evaluate(KeyError("x"), 1, 3).action is RetryAction.DEFAULT
