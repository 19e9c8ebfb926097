"""On the floor Prefect (3.6): a crashed job is redelivered (the retry condition is called: on
3.6-3.8 only a plain function is), a permanent exit code is not, @sandbox_task works."""

from __future__ import annotations

from typing import Any

from prefect import flow

from prefect_blocks import PandaStackCredentials, SandboxJobFailed, run_in_sandbox, sandbox_task
from tests.support.prefect_readback import flow_run_id, task_runs


@sandbox_task
def double(x: int) -> int:
    return 2 * x


def test_redelivery_dead_letter_and_sandbox_task(local_server: Any, monkeypatch) -> None:
    for name, value in local_server.env().items():
        monkeypatch.setenv(name, value)
    creds = PandaStackCredentials(api_url=local_server.url, api_key=local_server.api_key)

    @flow
    def floor() -> dict:
        crash = run_in_sandbox.with_options(retries=1, name="crash")(
            "exit 1", result_path=None, timeout=30, credentials=creds, return_state=True
        )
        permanent = run_in_sandbox.with_options(retries=2, name="permanent")(
            "exit 3", permanent_exit_codes=[3], result_path=None, timeout=30, credentials=creds,
            return_state=True,
        )  # fmt: skip
        return {"crash": crash, "permanent": permanent, "double": double(21)}

    state = floor(return_state=True)
    out = state.result(raise_on_failure=False)
    assert out["double"] == 42
    assert out["crash"].is_failed() and out["permanent"].is_failed()
    assert isinstance(out["crash"].result(raise_on_failure=False), SandboxJobFailed)
    runs = {r.name.rsplit("-", 1)[0]: r.run_count for r in task_runs(flow_run_id(state))}
    assert runs["crash"] == 2, runs  # redelivered once: the retry condition ran
    assert runs["permanent"] == 1, runs  # dead-lettered: not retried
    assert local_server.client().sandboxes.list() == []
