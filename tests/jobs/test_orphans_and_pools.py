"""Orphans of killed workers, warm fork pools and detached jobs, against pandastack_local."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pandastack
import pytest

from pandastack_jobs import (
    FailureKind,
    JobKey,
    JobSpec,
    WarmPool,
    WarmupFailed,
    finish_detached,
    poll_detached,
    run_job,
    start_detached,
)

WORKER = textwrap.dedent(
    """
    import sys
    from pandastack_jobs import ConnectionConfig, JobKey, JobSpec, run_job
    url, key = sys.argv[1], sys.argv[2]
    client = ConnectionConfig(api_url=url, api_key=key).client()
    key = JobKey("test", "wf", "killed", "run-9", try_number=1)
    spec = JobSpec(command="sleep 120", timeout=150, key=key)
    run_job(client, spec, on_created=lambda sid: print("CREATED", sid, flush=True))
    """
)


def test_worker_killed_mid_exec_leaves_an_orphan_that_the_next_try_reaps(local_server, ps_client) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, local_server.url, local_server.api_key],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("CREATED "), line
    orphan_id = line.split()[1]
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert orphan_id in {sb.id for sb in ps_client.sandboxes.list()}  # the orphan is real

    key2 = JobKey("test", "wf", "killed", "run-9", try_number=2)
    created: list[str] = []
    outcome = run_job(
        ps_client,
        JobSpec(command="echo 2 > /work/result.json", key=key2, timeout=30),
        on_created=created.append,
    )
    assert outcome.ok and outcome.result == 2
    assert orphan_id not in {sb.id for sb in ps_client.sandboxes.list()}
    assert created and created[0] != orphan_id


WARMUP = "import random, json; json.dump({'token': random.random()}, open('/work/warm.json', 'w'))"


def test_warm_pool_runs_warmup_once_and_isolates_children(ps_client: pandastack.Client) -> None:
    warmup = JobSpec(
        command="python3 warm.py && echo ran >> /work/warmups.log",
        files={"warm.py": WARMUP},
        result_path="/work/warm.json",
        timeout=60,
    )
    read_state = (
        'cat /work/warm.json > /work/result.json.tmp && python3 -c "import json; '
        "w=json.load(open('/work/warm.json')); n=len(open('/work/warmups.log').read().split()); "
        "json.dump({'token': w['token'], 'warmups': n}, open('/work/result.json','w'))\""
    )
    corrupt = "rm -f /work/warm.json && echo corrupted > /work/warmups.log && echo '{}' > /work/result.json"
    with WarmPool(ps_client, warmup) as pool:
        assert pool.warmup_outcome is not None and pool.warmup_outcome.ok
        token = pool.warmup_outcome.result["token"]
        first = pool.run(JobSpec(command=read_state, timeout=30))
        bad = pool.run(JobSpec(command=corrupt, timeout=30))
        after = pool.run(JobSpec(command=read_state, timeout=30))
        assert first.ok and bad.ok and after.ok, (first.reason, bad.reason, after.reason)
        assert first.result == {"token": token, "warmups": 1}
        assert after.result == {"token": token, "warmups": 1}  # the corrupting sibling changed nothing
        assert len({first.sandbox_id, bad.sandbox_id, after.sandbox_id, pool.parent_id}) == 4
        parent = ps_client.sandboxes.get(pool.parent_id)
        assert b'"token"' in parent.filesystem.read("/work/warm.json")
        children = [
            sb for sb in ps_client.sandboxes.list() if sb.metadata.get("forked_from") == pool.parent_id
        ]
        assert children == []  # every child was deleted after its job
    assert pool.parent_id not in {sb.id for sb in ps_client.sandboxes.list()}


def test_fork_children_get_a_ttl(ps_client: pandastack.Client) -> None:
    with WarmPool(ps_client, JobSpec(command="true", result_path=None, timeout=30)) as pool:
        child = pool.fork(JobSpec(command="true", timeout=40))
        try:
            assert child.lifecycle()["ttl_seconds"] == 100
        finally:
            child.kill()


def test_failed_warmup_deletes_the_parent(ps_client: pandastack.Client) -> None:
    with pytest.raises(WarmupFailed) as info:
        with WarmPool(ps_client, JobSpec(command="exit 7", result_path=None, timeout=30)):
            pass
    assert "exit code 7" in str(info.value)


def test_pool_attached_from_elsewhere_runs_and_closes(ps_client: pandastack.Client) -> None:
    parent_id = WarmPool(
        ps_client, JobSpec(command="echo hi > /work/hi", result_path=None, timeout=30)
    ).start_parent()
    pool = WarmPool.attach(ps_client, parent_id)
    outcome = pool.run(
        JobSpec(command="cp /work/hi /work/result.json.txt && echo '\"ok\"' > /work/result.json")
    )
    assert outcome.ok and outcome.result == "ok"
    leftover = pool.fork(JobSpec(command="true"))  # a child a crashed job would leave behind
    pool.close()
    ids = {sb.id for sb in ps_client.sandboxes.list()}
    assert parent_id not in ids and leftover.id not in ids


def test_detached_job_runs_after_the_exec_returns(ps_client: pandastack.Client) -> None:
    spec = JobSpec(command="sleep 1; echo out; echo '{\"x\": 1}' > /work/result.json", timeout=30)
    job = start_detached(ps_client, spec)
    assert not isinstance(job, type(None)) and hasattr(job, "sandbox_id"), job
    assert poll_detached(ps_client, job.sandbox_id) is None  # still running
    deadline = time.monotonic() + 20
    while poll_detached(ps_client, job.sandbox_id) is None:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    seen: list[tuple[str, str]] = []
    outcome = finish_detached(ps_client, spec, job, on_output=lambda s, c: seen.append((s, c)))
    assert outcome.ok and outcome.result == {"x": 1}
    assert "out" in outcome.stdout_tail
    assert ("stdout", "out\n") in seen


def test_detached_job_failures_are_classified(ps_client: pandastack.Client) -> None:
    spec = JobSpec(command="echo bad >&2; exit 4", timeout=30)
    job = start_detached(ps_client, spec)
    assert hasattr(job, "sandbox_id")
    deadline = time.monotonic() + 20
    while poll_detached(ps_client, job.sandbox_id) is None:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    outcome = finish_detached(ps_client, spec, job)
    assert outcome.kind is FailureKind.EXIT_CODE and outcome.exit_code == 4 and "bad" in outcome.reason


def test_detached_job_whose_sandbox_vanished_is_redelivered(ps_client: pandastack.Client) -> None:
    spec = JobSpec(command="sleep 30", timeout=60)
    job = start_detached(ps_client, spec)
    ps_client.sandboxes.delete(job.sandbox_id)
    outcome = finish_detached(ps_client, spec, job)
    assert outcome.kind is FailureKind.SANDBOX_LOST and outcome.redeliver


def test_pool_jobs_and_parents_reap_earlier_attempts(ps_client: pandastack.Client) -> None:
    old_job = ps_client.sandboxes.create(
        template="base",
        ttl_seconds=120,
        metadata=JobKey("test", "wf", "fork-job", "r1", try_number=1).metadata(),
    )
    old_parent = ps_client.sandboxes.create(
        template="base", ttl_seconds=120, metadata=JobKey("test", "wf", "warm", "r1", try_number=1).metadata()
    )
    warm_key = JobKey("test", "wf", "warm", "r1", try_number=2)
    with WarmPool(ps_client, JobSpec(command="true", result_path=None, key=warm_key)) as pool:
        assert old_parent.id not in {sb.id for sb in ps_client.sandboxes.list()}
        job_key = JobKey("test", "wf", "fork-job", "r1", try_number=2)
        outcome = pool.run(JobSpec(command="echo 1 > /work/result.json", key=job_key))
        assert outcome.ok
        assert old_job.id not in {sb.id for sb in ps_client.sandboxes.list()}
