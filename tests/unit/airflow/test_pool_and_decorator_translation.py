"""The warm-fork operators and ``@task.pandastack``: translation only, through :class:`FakeClient`."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pandastack_jobs.pyfunc import COMMAND, SCRIPT_PATH
from pandastack_jobs.spec import INPUT_PATH
from pandastack_jobs.testing import FakeClient, FakeSandbox, Script
from tests.unit.airflow.tis import TI, context


def test_setup_fork_and_teardown_share_one_warm_parent(wired: FakeClient) -> None:
    from airflow_provider.operators.warm_fork import (
        PandaStackForkOperator,
        PandaStackWarmPoolSetupOperator,
        PandaStackWarmPoolTeardownOperator,
    )

    wired.script("warm.py", result={"model": "v1"}, files={"/work/model.bin": b"w"})
    setup_ctx = context()
    parent = PandaStackWarmPoolSetupOperator(task_id="warm", command="python3 warm.py").execute(setup_ctx)
    assert setup_ctx["ti"].xcom["warmup"] == {"model": "v1"} and wired.live() == [parent]
    assert setup_ctx["task_state_store"]["pandastack_sandbox_id"] == parent  # the next try reaps it

    seen: list[str] = []

    def score(sb: FakeSandbox, call: Any) -> None:
        seen.append(sb.metadata["forked_from"])
        assert sb.files["/work/model.bin"] == b"w"  # the parent's disk

    wired.script("score.py", Script(action=score, result=1))
    for n in range(2):
        op = PandaStackForkOperator(task_id="score", parent_id=parent, command="python3 score.py")
        assert op.execute(context(TI(map_index=n))) == 1
    assert seen == [parent, parent] and wired.live() == [parent]

    wired.add_sandbox(metadata={"forked_from": parent})  # a fork a crashed job left
    PandaStackWarmPoolTeardownOperator(task_id="cool", parent_id=parent).execute(context())
    assert wired.live() == []


def test_a_failed_warmup_is_the_outcomes_exception_and_leaves_nothing(wired: FakeClient) -> None:
    from airflow_provider.exceptions import PandaStackJobDeadLetter
    from airflow_provider.operators.warm_fork import PandaStackWarmPoolSetupOperator

    wired.script("warm.py", exit_code=4, stderr="no weights\n")
    op = PandaStackWarmPoolSetupOperator(task_id="warm", command="python3 warm.py", permanent_exit_codes=[4])
    with pytest.raises(PandaStackJobDeadLetter, match="no weights"):
        op.execute(context())
    assert wired.live() == []


def test_a_fork_without_a_parent_fails_and_a_teardown_without_one_does_nothing(wired: FakeClient) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider.operators.warm_fork import (
        PandaStackForkOperator,
        PandaStackWarmPoolTeardownOperator,
    )

    with pytest.raises(AirflowFailException, match="parent_id is empty"):
        PandaStackForkOperator(task_id="s", parent_id="", command="x").execute(context())
    PandaStackWarmPoolTeardownOperator(task_id="cool", parent_id=None).execute(context())
    with pytest.raises(ValueError, match="deferrable"):
        PandaStackForkOperator(task_id="s", parent_id="p", command="x", deferrable=True)
    assert wired.requests == []


def _decorated(fn: Any, *args: Any, **kwargs: Any) -> Any:
    from airflow_provider.decorators.pandastack import _PandaStackDecoratedOperator

    return _PandaStackDecoratedOperator(task_id="fn", python_callable=fn, op_args=args, op_kwargs=kwargs)


def add(a: int, b: int = 0) -> int:
    return a + b


def test_task_pandastack_ships_the_source_and_json_arguments_and_returns_the_json_result(
    wired: FakeClient,
) -> None:
    shipped: dict[str, Any] = {}

    def job(sb: FakeSandbox, call: Any) -> Script:
        shipped["source"] = sb.files[SCRIPT_PATH].decode()
        payload = json.loads(sb.files[INPUT_PATH])
        return Script(result=add(*payload["args"], **payload["kwargs"]))

    wired.script(COMMAND, Script(action=job))
    assert _decorated(add, 2, b=5).execute(context()) == 7
    source = shipped["source"]
    # Annotations stay text in the sandbox (typing's names are not imported there).
    assert source.startswith("from __future__ import annotations\n\ndef add(")
    assert "return a + b" in source and "pickle" not in source


def test_task_pandastack_refuses_arguments_that_are_not_json(wired: FakeClient) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    with pytest.raises(AirflowFailException, match=r"@task\.pandastack: .*JSON"):
        _decorated(add, object()).execute(context())
    assert wired.live() == [] and wired.execs == []


def test_task_pandastack_takes_no_command() -> None:
    from airflow_provider.decorators.pandastack import _PandaStackDecoratedOperator

    with pytest.raises(TypeError, match="does not take 'command'"):
        _PandaStackDecoratedOperator(task_id="fn", python_callable=add, op_args=[1], command="rm -rf /")
