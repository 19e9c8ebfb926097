"""Fault injection through the core: a SIGKILLed worker, a restarted server, capacity refusals,
bad credentials / template / server down, and a teardown that fails after a good result."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandastack
import pytest

from pandastack_jobs import (
    ConnectionConfig,
    FailureClass,
    FailureKind,
    JobKey,
    JobSpec,
    run_job,
    sweep_job,
)
from pandastack_local.testing.waiting import wait_for
from tests.reliability import rel_worker
from tests.reliability.catalogue import TEMPLATE
from tests.reliability.probes import HostProbe, Recorder, outcome_text, secret_free

pytestmark = pytest.mark.reliability
HERE = Path(__file__).parent


def connect(server: Any, **kwargs: Any) -> Any:
    return ConnectionConfig(api_url=server.url, api_key=server.api_key, **kwargs).client()


def test_sigkilled_worker_job_runs_exactly_once_more_and_delivers_once(rel_server: Any, host: Any) -> None:
    client = connect(rel_server)
    run = uuid.uuid4().hex
    worker = subprocess.Popen(
        [sys.executable, str(HERE / "rel_worker.py"), run, "1"],
        env={**os.environ, **rel_server.env()},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(worker.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_for(
            "the first try's job to start",
            lambda: any("started" in line for line in lines),
            timeout=90,
            interval=0.05,
        )
        orphan_id = next(line.split()[1] for line in lines if line.startswith("CREATED"))
        orphan_trace = host.trace(orphan_id)
        assert host.alive(orphan_trace)
        worker.kill()  # SIGKILL: no finally, no teardown
        worker.wait(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
    reader.join(timeout=10)
    assert not any(line.startswith("DELIVERED") for line in lines), lines
    # The orphan is really there, still running its job.
    left = client.sandboxes.list()
    assert [sb.id for sb in left] == [orphan_id]
    assert left[0].metadata["job_try"] == "1"

    # The retry (try 2 of the same job) reaps the orphan, runs the job once, delivers once.
    recorder = Recorder(host)
    outputs: list[str] = []
    delivered = []
    outcome = run_job(
        client, rel_worker.spec(run, 2), on_created=recorder, on_output=lambda s, c: outputs.append(c)
    )
    if outcome.ok:
        delivered.append(outcome.result)
    assert outcome.ok, outcome_text(outcome)
    assert delivered == [{"delivered_by": "2"}]
    assert len(recorder.traces) == 1 and recorder.traces[0].sandbox_id != orphan_id
    assert "".join(outputs).count("started") == 1
    assert host.wait_clean(orphan_trace) == []
    assert host.wait_clean(recorder.traces[0]) == []
    assert client.sandboxes.list() == []


def test_server_restart_mid_exec_is_redelivered_and_succeeds(
    make_local_server: Any, rel_templates: Path, host: Any
) -> None:
    server = make_local_server(template_dirs=[str(rel_templates / TEMPLATE)])
    client = connect(server)
    key = JobKey("core", "reliability", "restart", uuid.uuid4().hex)
    spec = JobSpec(
        command="echo started; sleep 5; echo '{\"ok\": true}' > result.json",
        template=TEMPLATE,
        timeout=60,
        key=key,
    )
    started = threading.Event()
    ids: list[str] = []
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(
            run_job,
            client,
            spec,
            on_created=ids.append,
            on_output=lambda s, c: started.set() if "started" in c else None,
        )
        assert started.wait(90), "the job never started"
        probe = HostProbe(server)
        trace = probe.trace(ids[0])
        assert probe.alive(trace)
        server.restart()  # SIGKILL + start on the same port, key and state dir
        first = future.result(timeout=120)
    assert not first.ok, outcome_text(first)
    assert first.failure_class is FailureClass.REDELIVER, outcome_text(first)
    assert first.kind in (FailureKind.SANDBOX_LOST, FailureKind.CONNECTION), outcome_text(first)
    # The restarted server holds nothing of the old run; its processes died with it.
    assert client.sandboxes.list() == []
    assert probe.wait_clean(trace) == []

    retry = run_job(client, replace(spec, key=replace(key, try_number=2)))
    assert retry.ok and retry.result == {"ok": True}, outcome_text(retry)
    assert client.sandboxes.list() == []


def test_capacity_refusals_wait_and_every_job_completes(make_local_server: Any, rel_templates: Path) -> None:
    server = make_local_server(template_dirs=[str(rel_templates / TEMPLATE)], max_sandboxes=2, pool_size=0)
    refusals: list[Any] = []
    client = pandastack.Client(
        api_url=server.url,
        api_key=server.api_key,
        max_create_retry_seconds=180,
        on_create_retry=refusals.append,
    )
    specs = [
        JobSpec(
            command=f"sleep 1; echo '{{\"n\": {i}}}' > result.json",
            template=TEMPLATE,
            timeout=60,
            key=JobKey("core", "reliability", "capacity", uuid.uuid4().hex, map_index=i),
        )
        for i in range(8)
    ]
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda s: run_job(client, s), specs))
    assert [o.result for o in outcomes] == [{"n": i} for i in range(8)], [o.reason for o in outcomes]
    assert refusals, "the server never refused: the test did not reach max_sandboxes"
    assert client.sandboxes.list() == []

    # With no retry budget left, a refusal is a classified, delayed redelivery.
    holders = [client.sandboxes.create(template=TEMPLATE) for _ in range(2)]
    try:
        impatient = connect(server, max_create_retry_seconds=0)
        refused = run_job(impatient, JobSpec(command="true", template=TEMPLATE, result_path=None, timeout=10))
    finally:
        for sb in holders:
            sb.kill()
    assert refused.kind is FailureKind.CAPACITY and refused.redeliver, outcome_text(refused)
    assert refused.retry_after is not None and refused.retry_after >= 1
    assert refused.sandbox_id is None


def test_wrong_key_unknown_template_and_server_down_are_clear_and_classified(
    rel_server: Any, make_local_server: Any
) -> None:
    wrong_key = "pds_" + "0" * 32
    bad = run_job(
        ConnectionConfig(api_url=rel_server.url, api_key=wrong_key).client(),
        JobSpec(command="true", template=TEMPLATE, timeout=10),
    )
    assert bad.kind is FailureKind.AUTH and bad.failure_class is FailureClass.DEAD_LETTER, outcome_text(bad)
    assert "create" in bad.reason and secret_free(outcome_text(bad), wrong_key, rel_server.api_key) == []

    unknown = run_job(connect(rel_server), JobSpec(command="true", template="no-such-template", timeout=10))
    assert unknown.kind is FailureKind.UNKNOWN_TEMPLATE and unknown.dead_letter, outcome_text(unknown)
    assert "no-such-template" in unknown.reason

    down = make_local_server()
    down_client = connect(down, request_timeout=5)
    down.stop()
    started = time.monotonic()
    gone = run_job(down_client, JobSpec(command="true", timeout=10))
    assert gone.kind is FailureKind.CONNECTION and gone.redeliver, outcome_text(gone)
    assert "create failed" in gone.reason and "Connection refused" in gone.reason
    assert str(down.port) in gone.reason
    assert time.monotonic() - started < 120
    assert secret_free(outcome_text(gone), down.api_key) == []


class _FailingDeletes:
    """The SDK's sandbox collection with every delete failing (a network blip at teardown)."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def delete(self, sandbox_id: str) -> None:
        raise pandastack.ServerError("injected: connection reset during delete")


class _TeardownFails:
    def __init__(self, client: Any) -> None:
        self._client = client
        self.sandboxes = _FailingDeletes(client.sandboxes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def test_failed_teardown_after_a_good_result_succeeds_and_the_sweep_removes_it(
    rel_server: Any, host: Any, make_local_server: Any, rel_templates: Path
) -> None:
    client = connect(rel_server)
    key = JobKey("core", "reliability", "teardown", uuid.uuid4().hex)
    recorder = Recorder(host)
    outcome = run_job(
        _TeardownFails(client),
        JobSpec(command="echo '{\"v\": 7}' > result.json", template=TEMPLATE, timeout=30, key=key),
        on_created=recorder,
    )
    assert outcome.ok and outcome.result == {"v": 7}, outcome_text(outcome)
    assert outcome.teardown_error and "injected" in outcome.teardown_error
    assert [sb.id for sb in client.sandboxes.list()] == [outcome.sandbox_id]  # really left behind
    assert sweep_job(client, key) == [outcome.sandbox_id]
    assert client.sandboxes.list() == []
    assert host.wait_clean(recorder.traces[0]) == []

    # Without anyone sweeping, the TTL backstop removes it.
    ttl_server = make_local_server(template_dirs=[str(rel_templates / TEMPLATE)], ttl_scan_interval=0.5)
    ttl_client = connect(ttl_server)
    kept = run_job(
        _TeardownFails(ttl_client),
        JobSpec(command="echo '{}' > result.json", template=TEMPLATE, timeout=1, ttl=2),
    )
    assert kept.ok and kept.teardown_error, outcome_text(kept)
    wait_for(
        "the TTL to reap the sandbox", lambda: ttl_client.sandboxes.list() == [], timeout=60, interval=0.05
    )
