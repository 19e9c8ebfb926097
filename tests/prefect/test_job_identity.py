"""A job is one call: identical calls in one flow run are separate jobs with separate artifacts.

Real flows (prefect_test_harness) against pandastack_local; the killed-worker re-run is
covered by tests/prefect/test_cleanup.py.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from prefect import flow

from prefect_blocks import run_in_sandbox
from tests.support.prefect_readback import artifacts, flow_run_id, task_runs

# Identical calls: same command, files, input and template (the old key's fingerprint).
TWIN_JOB = "sleep 4; echo '{\"twin\": true}' > /work/result.json"


class SandboxKiller(threading.Thread):
    """Deletes one of the flow's two live sandboxes once both exist: that call fails once (lost)."""

    def __init__(self, client: Any, workflow: str) -> None:
        super().__init__(daemon=True)
        self.client = client
        self.workflow = workflow
        self.seen: list[Any] = []
        self.killed: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and self.killed is None:
                live = [
                    sb
                    for sb in self.client.sandboxes.list()
                    if (sb.metadata or {}).get("job_workflow") == self.workflow
                ]
                if len(live) >= 2:
                    self.seen = live
                    self.killed = live[0]
                    self.client.sandboxes.delete(live[0].id)
                time.sleep(0.05)
        except BaseException as exc:
            self.error = exc


def recorded_task_runs(run_id: Any, count: int) -> dict[str, Any]:
    """The flow run's task runs by id, once the API has recorded ``count`` of them (events lag)."""
    deadline = time.monotonic() + 30
    while True:
        runs = {str(run.id): run for run in task_runs(run_id)}
        final = [run for run in runs.values() if run.state and run.state.is_final()]
        if len(final) >= count or time.monotonic() > deadline:
            assert len(runs) == count, runs
            return runs
        time.sleep(0.5)


def test_identical_calls_in_one_flow_run_do_not_reap_each_other(credentials, ps_client) -> None:
    @flow(name="twin-calls")
    def twin_calls() -> list[Any]:
        first = run_in_sandbox.submit(command=TWIN_JOB, credentials=credentials, timeout=60)
        second = run_in_sandbox.submit(command=TWIN_JOB, credentials=credentials, timeout=60)
        return [first.result(), second.result()]

    killer = SandboxKiller(ps_client, "twin-calls")
    killer.start()
    state = twin_calls(return_state=True)
    killer.join(timeout=60)
    assert killer.error is None, killer.error
    assert killer.killed is not None, "the two sandboxes were never live together"

    # Two calls, two jobs: each names its own task run, so neither attempt can reap the other.
    job_ids = {sb.metadata["job_id"] for sb in killer.seen}
    assert len(job_ids) == 2, f"identical calls share one job id: {killer.seen}"
    assert state.is_completed(), state.message
    assert state.result() == [{"twin": True}, {"twin": True}]
    runs = list(recorded_task_runs(flow_run_id(state), 2).values())
    assert all(run.state.is_completed() for run in runs)
    # The call whose sandbox was deleted ran twice; its twin ran once: the retry did not reap it.
    assert sorted(run.run_count for run in runs) == [1, 2], [(r.name, r.run_count) for r in runs]
    killed_task = killer.killed.metadata["job_task"]
    retried = next(run for run in runs if run.run_count == 2)
    assert killed_task.endswith(f":{retried.id}"), (killed_task, retried.id)


def test_dead_letters_of_same_named_tasks_get_one_artifact_each(credentials) -> None:
    @flow(name="two-dead-letters")
    def two_dead_letters() -> None:
        futures = [
            run_in_sandbox.submit(
                command=f"echo bad input {name} >&2; exit 9",
                credentials=credentials,
                permanent_exit_codes=[9],
                timeout=30,
            )
            for name in ("a", "b")
        ]
        for future in futures:
            future.wait()

    state = two_dead_letters(return_state=True)
    run_id = flow_run_id(state)
    runs = recorded_task_runs(run_id, 2)
    assert all(run.state.is_failed() for run in runs.values())
    dead = [a for a in artifacts(run_id) if "dead-letter" in (a.key or "")]
    assert len(dead) == 2, [a.key for a in dead]
    # One key per task run (so neither is a second version of the other), and it names the run.
    keys = {a.key for a in dead}
    assert len(keys) == 2, keys
    for artifact in dead:
        assert artifact.key.startswith("run-in-sandbox-dead-letter-"), artifact.key
        owner = artifact.key.removeprefix("run-in-sandbox-dead-letter-")
        assert owner in runs and artifact.task_run_id == runs[owner].id, artifact.key
    assert sorted("bad input a" in a.data for a in dead) == [False, True]
