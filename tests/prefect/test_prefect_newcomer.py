"""Issue 25 for Prefect: a bare ``@sandbox_task`` finds the saved default credentials block, a
missing key says how to give one, a worker without credentials refuses to start, and the retry
condition is a plain function (Prefect 3.6-3.8 call only those: ``inspect.isfunction``)."""

from __future__ import annotations

import functools
import inspect
import uuid
from pathlib import Path

import anyio
import pandastack
import pytest
from prefect import flow

from prefect_blocks import (
    PandaStackCredentials,
    make_retry_condition,
    retry_on_redeliver,
    run_in_sandbox,
    sandbox_task,
)
from prefect_blocks.worker import PandaStackWorker

DEFAULT_BLOCK_ENV = "PREFECT_INTEGRATIONS_PANDASTACK_CREDENTIALS_BLOCK"


@sandbox_task
def double(x: int) -> int:
    return 2 * x


@pytest.fixture
def no_sdk_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Nothing the SDK could find a key in: no variables, an empty home (~/.config/pandastack)."""
    for name in ("PANDASTACK_API_KEY", "PANDASTACK_API", DEFAULT_BLOCK_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / ".config"))


def test_bare_sandbox_task_uses_the_saved_default_block(no_sdk_credentials, credentials, local_server):
    credentials.save("default", overwrite=True)
    try:

        @flow
        def bare() -> int:
            return double(21)

        assert bare() == 42
        assert local_server.client().sandboxes.list() == []
    finally:
        PandaStackCredentials.delete("default")


def test_a_named_default_block_and_the_error_without_one(no_sdk_credentials, credentials, monkeypatch):
    name = f"creds-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(DEFAULT_BLOCK_ENV, name)

    @flow
    def bare() -> object:
        return run_in_sandbox("echo '7' > /work/result.json", timeout=30)

    state = bare(return_state=True)
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert "credentials=PandaStackCredentials.load" in message and name in message, message
    assert "PANDASTACK_API_KEY" in message
    credentials.save(name)
    try:
        assert bare() == 7
    finally:
        PandaStackCredentials.delete(name)


def test_worker_without_credentials_refuses_to_start(no_sdk_credentials) -> None:
    pool = f"no-creds-{uuid.uuid4().hex[:8]}"
    worker = PandaStackWorker(work_pool_name=pool)
    with pytest.raises(pandastack.AuthError) as caught:
        anyio.run(functools.partial(worker.start, run_once=True))
    assert pool in str(caught.value) and "PANDASTACK_API_KEY" in str(caught.value)


def test_retry_conditions_are_plain_functions() -> None:
    # Prefect 3.6-3.8 skip a retry_condition_fn that is not inspect.isfunction (retries silently off).
    assert inspect.isfunction(retry_on_redeliver)
    assert inspect.isfunction(make_retry_condition())
    assert inspect.isfunction(run_in_sandbox.retry_condition_fn)
    assert inspect.isfunction(double.retry_condition_fn)
