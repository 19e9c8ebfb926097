"""The Prefect adapter only translates: a block and a call → the core's job, the outcome → a
return value or a :class:`SandboxJobFailed`, and redelivery → Prefect's retry condition.

No flow run here (no Prefect API): the task bodies are called directly, as a run would.
The same paths through real flows and sandboxes are tests/prefect.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from uuid import uuid4

import pytest

from pandastack_jobs import FailureClass, FailureKind, JobOutcome
from pandastack_jobs.testing import FakeClient
from prefect_blocks import PandaStackSandbox
from prefect_blocks.exceptions import SandboxJobFailed
from prefect_blocks.execution import execute
from prefect_blocks.retries import Backoff, RetryOnRedeliver, take_redelivery_delay


def test_a_call_overrides_the_blocks_fields_and_none_keeps_them() -> None:
    """``None`` for an option that admits no None (timeout) still keeps the block's value: calls
    written when None meant "not given" keep working (test_a_ttl_of_none_is_the_cores_none)."""
    block = PandaStackSandbox(command="python3 a.py", timeout=50, env={"A": "1"}, publish_artifacts=False)
    request = block.request(timeout=None, env={"B": "2"}, collect=["out.csv"])
    spec = request.spec
    assert (spec.command, spec.timeout, dict(spec.env), spec.collect) == (
        "python3 a.py",
        50,
        {"B": "2"},
        ("/work/out.csv",),
    )
    assert request.publish_artifacts is False and spec.key is None  # no flow run: nothing to reap by
    with pytest.raises(TypeError, match="unknown sandbox option"):
        block.request(cpus=4)
    with pytest.raises(ValueError, match="command"):
        PandaStackSandbox().request()


def test_text_options_are_coerced_and_bad_ones_name_the_field() -> None:
    spec = PandaStackSandbox().request("x", env='{"N": 1}', permanent_exit_codes="[3]").spec
    assert dict(spec.env) == {"N": "1"} and spec.permanent_exit_codes == frozenset({3})
    with pytest.raises(ValueError, match="ttl"):
        PandaStackSandbox().request("x", timeout=100, ttl=5)


def test_run_returns_the_result_and_leaves_no_sandbox(wired: FakeClient) -> None:
    wired.script("python3 a.py", result=[1, 2], stdout="hi\n")
    block = PandaStackSandbox(publish_artifacts=False, timeout=9)
    assert block.run("python3 a.py", input={"x": 1}) == [1, 2]
    assert wired.execs[-1].timeout == 9 and wired.live() == []


def test_run_in_sandbox_takes_every_option_as_a_parameter(wired: FakeClient) -> None:
    from prefect_blocks import run_in_sandbox

    wired.script("job", result="ok")
    assert run_in_sandbox.fn("job", timeout=7, env={"K": "v"}, publish_artifacts=False) == "ok"
    call = wired.execs[-1]
    assert call.timeout == 7 and call.env["K"] == "v"


@pytest.mark.parametrize(
    ("script", "kind", "redeliver"),
    [
        ({"exit_code": 1}, FailureKind.EXIT_CODE, True),
        ({"exit_code": 3}, FailureKind.PERMANENT_EXIT_CODE, False),
        ({}, FailureKind.RESULT_MISSING, False),
    ],
)
def test_a_failure_raises_sandbox_job_failed_with_its_class(
    wired: FakeClient, script: dict[str, int], kind: FailureKind, redeliver: bool
) -> None:
    wired.script("job", **script)
    block = PandaStackSandbox(publish_artifacts=False, permanent_exit_codes=[3])
    with pytest.raises(SandboxJobFailed) as caught:
        execute(block.request("job"))
    error = caught.value
    assert error.kind is kind and error.redeliver is redeliver and error.dead_letter is not redeliver
    again = pickle.loads(pickle.dumps(error))  # Prefect stores it in the Failed state
    assert again.summary == error.summary and again.message == error.message
    assert wired.live() == []


def test_a_capacity_refusal_carries_retry_after(wired: FakeClient) -> None:
    wired.refuse_capacity(retry_after=None)
    with pytest.raises(SandboxJobFailed) as caught:
        execute(PandaStackSandbox(publish_artifacts=False).request("job"))
    assert caught.value.kind is FailureKind.CAPACITY and caught.value.retry_after == 5.0


def test_the_key_never_reaches_the_job_and_is_redacted_from_the_failure(wired: FakeClient) -> None:
    assert wired.api_key
    wired.script("job", exit_code=1, stderr=f"token {wired.api_key}\n")
    with pytest.raises(SandboxJobFailed) as caught:
        execute(PandaStackSandbox(publish_artifacts=False).request("job"))
    assert wired.api_key not in caught.value.message and wired.api_key not in str(caught.value.summary)
    assert all(wired.api_key not in call.line for call in wired.execs)


def _failed(kind: FailureKind, cls: FailureClass, retry_after: float | None = None) -> SimpleNamespace:
    outcome = JobOutcome(ok=False, kind=kind, failure_class=cls, reason="r", retry_after=retry_after)
    return SimpleNamespace(data=SandboxJobFailed.from_outcome(outcome))


def test_the_retry_condition_retries_only_redeliverable_failures_after_retry_after() -> None:
    condition = RetryOnRedeliver(Backoff(base=1.0, cap=4.0))
    ours = SimpleNamespace(retry_delay_seconds=SimpleNamespace())  # a task that set its own delay
    run = SimpleNamespace(id=uuid4(), run_count=1)
    assert condition(None, run, _failed(FailureKind.CAPACITY, FailureClass.REDELIVER, 30)) is True
    assert take_redelivery_delay(run.id) >= 30
    assert condition(ours, run, _failed(FailureKind.EXIT_CODE, FailureClass.REDELIVER)) is True
    assert take_redelivery_delay(run.id) == 0  # the task's own delay: only capacity holds it back
    assert condition(None, run, _failed(FailureKind.AUTH, FailureClass.DEAD_LETTER)) is False
    assert condition(None, run, SimpleNamespace(data=KeyError("x"))) is False
    assert take_redelivery_delay(run.id) == 0


def test_backoff_doubles_within_its_cap_and_respects_retry_after() -> None:
    backoff = Backoff(base=2.0, cap=10.0, jitter=0.5)
    for n, ceiling in ((1, 2.0), (2, 4.0), (3, 8.0), (9, 10.0)):
        assert all(ceiling / 2 <= backoff.delay(n) <= ceiling for _ in range(20))
    assert backoff.delay(1, retry_after=60) >= 60
