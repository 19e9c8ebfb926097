"""The one lifecycle, end to end against pandastack_local through the real SDK."""

from __future__ import annotations

import threading
import time

import pandastack
import pytest

from pandastack_jobs import (
    FailureClass,
    FailureKind,
    JobHandle,
    JobKey,
    JobSpec,
    run_job,
)
from pandastack_jobs.connection import ConnectionConfig

ECHO_INPUT = (
    "import json; d = json.load(open('/work/input.json')); "
    "json.dump({'sum': sum(d['rows']), 'n': len(d['rows'])}, open('/work/result.json', 'w'))"
)


def test_success_returns_result_files_and_timings(ps_client: pandastack.Client) -> None:
    chunks: list[tuple[str, str]] = []
    created: list[str] = []
    spec = JobSpec(
        command="python3 job.py && echo done && echo '# Report' > report.md",
        files={"job.py": ECHO_INPUT},
        input={"rows": [1, 2, 3]},
        collect=["report.md"],
        timeout=30,
    )
    outcome = run_job(
        ps_client, spec, on_output=lambda s, c: chunks.append((s, c)), on_created=created.append
    )
    assert outcome.ok, outcome.reason
    assert outcome.failure_class is None
    assert outcome.result == {"sum": 6, "n": 3} and outcome.has_result
    assert outcome.files == {"/work/report.md": b"# Report\n"}
    assert outcome.exit_code == 0
    assert "done" in outcome.stdout_tail
    assert ("stdout", "done\n") in chunks or any("done" in c for s, c in chunks if s == "stdout")
    assert created == [outcome.sandbox_id]
    t = outcome.timings
    assert t.create > 0 and t.exec > 0 and t.delete > 0 and t.total >= t.create + t.exec
    with pytest.raises(pandastack.NotFoundError):
        ps_client.sandboxes.get(outcome.sandbox_id)


def test_nonzero_exit_is_redelivered_with_the_cause(ps_client: pandastack.Client) -> None:
    outcome = run_job(ps_client, JobSpec(command="echo boom >&2; exit 3", timeout=30))
    assert not outcome.ok
    assert outcome.kind is FailureKind.EXIT_CODE
    assert outcome.failure_class is FailureClass.REDELIVER and outcome.redeliver
    assert outcome.exit_code == 3
    assert "exit code 3" in outcome.reason and "boom" in outcome.reason
    assert "boom" in outcome.stderr_tail


def test_permanent_exit_code_is_dead_lettered(ps_client: pandastack.Client) -> None:
    spec = JobSpec(command="exit 3", timeout=30, permanent_exit_codes=[3])
    outcome = run_job(ps_client, spec)
    assert outcome.kind is FailureKind.PERMANENT_EXIT_CODE
    assert outcome.dead_letter
    assert "permanent exit code 3" in outcome.reason


def test_timeout_kills_a_sleeping_job_on_time(ps_client: pandastack.Client) -> None:
    started = time.monotonic()
    outcome = run_job(ps_client, JobSpec(command="sleep 600", timeout=2))
    elapsed = time.monotonic() - started
    assert outcome.kind is FailureKind.TIMEOUT, outcome.reason
    assert outcome.redeliver
    assert "2s timeout" in outcome.reason
    assert elapsed < 2 + 8, f"a 2 s job took {elapsed:.1f} s to be stopped"


def test_timeout_can_be_dead_lettered(ps_client: pandastack.Client) -> None:
    spec = JobSpec(command="sleep 600", timeout=1, retry_on_timeout=False)
    assert run_job(ps_client, spec).dead_letter


def test_a_job_that_ignores_sigterm_is_still_killed(ps_client: pandastack.Client) -> None:
    started = time.monotonic()
    outcome = run_job(ps_client, JobSpec(command="trap '' TERM; while :; do :; done", timeout=1))
    assert outcome.kind is FailureKind.TIMEOUT, outcome.reason
    assert time.monotonic() - started < 1 + 5 + 8


@pytest.mark.parametrize(
    ("command", "kind", "words"),
    [
        ("true", FailureKind.RESULT_MISSING, "wrote no result"),
        ("echo 'not json' > /work/result.json", FailureKind.RESULT_INVALID, "not valid JSON"),
        ("echo NaN > /work/result.json", FailureKind.RESULT_INVALID, "not valid JSON"),
        ("head -c 5000 /dev/zero | tr '\\0' 1 > /work/result.json", FailureKind.RESULT_TOO_LARGE, "cap"),
    ],
)
def test_bad_results_are_dead_lettered(
    ps_client: pandastack.Client, command: str, kind: FailureKind, words: str
) -> None:
    outcome = run_job(ps_client, JobSpec(command=command, timeout=30, max_result_bytes=1000))
    assert outcome.kind is kind, outcome.reason
    assert outcome.dead_letter
    assert words in outcome.reason
    assert outcome.exit_code == 0


def test_no_result_expected(ps_client: pandastack.Client) -> None:
    outcome = run_job(ps_client, JobSpec(command="true", result_path=None, timeout=30))
    assert outcome.ok and outcome.result is None and not outcome.has_result


def test_unknown_template_is_dead_lettered_clearly(ps_client: pandastack.Client) -> None:
    outcome = run_job(ps_client, JobSpec(command="true", template="no-such-template"))
    assert outcome.kind is FailureKind.UNKNOWN_TEMPLATE, outcome.reason
    assert outcome.dead_letter
    assert "no-such-template" in outcome.reason
    assert outcome.sandbox_id is None


def test_wrong_key_is_dead_lettered_and_never_shown(local_server) -> None:
    bad_key = "pds_" + "0" * 31 + "1"
    client = ConnectionConfig(api_url=local_server.url, api_key=bad_key).client()
    outcome = run_job(client, JobSpec(command="true"))
    assert outcome.kind is FailureKind.AUTH and outcome.dead_letter
    assert bad_key not in outcome.reason


def test_server_unreachable_is_redelivered() -> None:
    client = ConnectionConfig(api_url="http://127.0.0.1:9", api_key="pds_" + "1" * 32).client()
    outcome = run_job(client, JobSpec(command="true"))
    assert outcome.kind is FailureKind.CONNECTION, outcome.reason
    assert outcome.redeliver


def test_capacity_refusal_past_the_budget_is_redelivered_with_retry_after(make_local_server) -> None:
    server = make_local_server(max_sandboxes=1)
    holder = server.client().sandboxes.create(template="base", ttl_seconds=60)
    try:
        client = ConnectionConfig(
            api_url=server.url, api_key=server.api_key, max_create_retry_seconds=0
        ).client()
        outcome = run_job(client, JobSpec(command="true"))
        assert outcome.kind is FailureKind.CAPACITY, outcome.reason
        assert outcome.redeliver
        assert outcome.retry_after is not None and outcome.retry_after >= 1
    finally:
        holder.kill()


def test_capacity_refusal_waits_within_the_budget_then_runs(make_local_server) -> None:
    server = make_local_server(max_sandboxes=1)
    holder = server.client().sandboxes.create(template="base", ttl_seconds=60)
    threading.Timer(1.5, holder.kill).start()
    client = ConnectionConfig(
        api_url=server.url, api_key=server.api_key, max_create_retry_seconds=30
    ).client()
    outcome = run_job(client, JobSpec(command="echo '{}' > /work/result.json", timeout=30))
    assert outcome.ok, outcome.reason


def test_sandbox_deleted_mid_exec_is_redelivered(ps_client: pandastack.Client) -> None:
    def delete_soon(sandbox_id: str) -> None:
        threading.Timer(1.0, lambda: ps_client.sandboxes.delete(sandbox_id)).start()

    started = time.monotonic()
    outcome = run_job(ps_client, JobSpec(command="sleep 60", timeout=90), on_created=delete_soon)
    assert outcome.kind is FailureKind.SANDBOX_LOST, outcome.reason
    assert outcome.redeliver
    assert time.monotonic() - started < 30


def test_cancel_through_the_handle_never_succeeds(ps_client: pandastack.Client) -> None:
    handle = JobHandle()
    threading.Timer(1.0, handle.cancel).start()
    outcome = run_job(
        ps_client, JobSpec(command="sleep 60; echo '{}' > /work/result.json", timeout=90), handle=handle
    )
    assert not outcome.ok
    assert outcome.kind is FailureKind.CANCELLED and outcome.dead_letter


def test_secrets_in_job_output_are_redacted(ps_client: pandastack.Client) -> None:
    key = ps_client.api_key
    spec = JobSpec(command="echo leaked=$LEAK; echo err=$LEAK >&2; exit 1", env={"LEAK": key}, timeout=30)
    seen: list[str] = []
    outcome = run_job(ps_client, spec, on_output=lambda s, c: seen.append(c))
    assert key not in outcome.stdout_tail + outcome.stderr_tail + outcome.reason + "".join(seen)
    assert "leaked=***" in outcome.stdout_tail


def test_teardown_failure_after_a_good_result_is_still_success(
    ps_client: pandastack.Client, monkeypatch
) -> None:
    # Fault injection: the delete call fails (as on a network blip); the sandbox stays for the sweep.
    real_delete = ps_client.sandboxes.delete

    def failing_delete(sandbox_id: str) -> None:
        raise pandastack.ServerError("injected: agent unreachable")

    monkeypatch.setattr(ps_client.sandboxes, "delete", failing_delete)
    outcome = run_job(ps_client, JobSpec(command="echo '[1]' > /work/result.json", timeout=30))
    monkeypatch.setattr(ps_client.sandboxes, "delete", real_delete)
    assert outcome.ok and outcome.result == [1]
    assert outcome.teardown_error and "injected" in outcome.teardown_error
    assert ps_client.sandboxes.get(outcome.sandbox_id).id == outcome.sandbox_id  # still there...
    from pandastack_jobs import sweep_managed

    assert outcome.sandbox_id in sweep_managed(ps_client)  # ...until the sweep removes it


def test_earlier_attempts_are_reaped_before_the_next_try(ps_client: pandastack.Client) -> None:
    key1 = JobKey("test", "wf", "task", "run-1", try_number=1)
    orphan = ps_client.sandboxes.create(template="base", ttl_seconds=120, metadata=key1.metadata())
    unrelated = ps_client.sandboxes.create(
        template="base", ttl_seconds=120, metadata=JobKey("test", "wf", "other", "run-1").metadata()
    )
    try:
        key2 = JobKey("test", "wf", "task", "run-1", try_number=2)
        outcome = run_job(ps_client, JobSpec(command="echo 1 > /work/result.json", key=key2, timeout=30))
        assert outcome.ok
        ids = {sb.id for sb in ps_client.sandboxes.list()}
        assert orphan.id not in ids
        assert unrelated.id in ids
    finally:
        unrelated.kill()


def test_an_interrupt_mid_exec_still_deletes_the_sandbox(ps_client: pandastack.Client) -> None:
    class Interrupt(BaseException):
        """Stands in for KeyboardInterrupt or an engine's termination signal."""

    created: list[str] = []

    def interrupt_on_output(stream: str, chunk: str) -> None:
        raise Interrupt

    with pytest.raises(Interrupt):
        run_job(
            ps_client,
            JobSpec(command="echo started; sleep 60", timeout=90),
            on_created=created.append,
            on_output=interrupt_on_output,
        )
    assert created
    with pytest.raises(pandastack.NotFoundError):
        ps_client.sandboxes.get(created[0])


def _recording(client: pandastack.Client) -> list[tuple[str, str]]:
    """Record (method, route) of every request the SDK sends through ``client``."""
    calls: list[tuple[str, str]] = []
    send = client._request

    def record(method: str, path: str, *args: object, **kwargs: object) -> object:
        calls.append((method, path.rsplit("/", 1)[-1] if "/fs" in path or "/exec" in path else path))
        return send(method, path, *args, **kwargs)

    client._request = record  # type: ignore[method-assign]
    return calls


def test_a_fresh_job_is_one_exec_and_its_output_is_untouched(ps_client: pandastack.Client) -> None:
    """Files, input and result ride in the job's one exec (create, exec, delete: no fs round
    trip), and the job's own output reaches the log whole, with no trailer in it, even when
    the job prints its ancestors' command lines (where the trailer's printf is written)."""
    calls = _recording(ps_client)
    chunks: list[str] = []
    spec = JobSpec(
        command=(
            "python3 job.py && for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done"
            " && printf 'no newline'"
        ),
        files={"job.py": ECHO_INPUT, "lib/data.txt": "x'y\n"},
        input={"rows": [4, 5]},
        timeout=30,
    )
    outcome = run_job(ps_client, spec, on_output=lambda s, c: chunks.append(c) if s == "stdout" else None)
    assert outcome.ok and outcome.result == {"sum": 9, "n": 2}, outcome.reason
    assert [c for c in calls if c[1] in ("fs", "stat")] == [], calls
    assert [m for m, _ in calls] == ["POST", "POST", "DELETE"], calls
    out = "".join(chunks)
    assert "pandastack-result:%s" in out and out.endswith("no newline") and "\x1e" not in out
    assert outcome.stdout_tail == out


def test_a_result_the_fast_path_cannot_vouch_for_is_read_and_judged_as_before(
    ps_client: pandastack.Client,
) -> None:
    """Bytes that are not UTF-8 (the stream would replace them), a FIFO (never opened, never
    read: the job does not hang on it) and a result past the trailer's 1 MiB all go the old way."""
    bad = run_job(ps_client, JobSpec(command="printf '\\377\\376' > /work/result.json", timeout=30))
    assert bad.kind is FailureKind.RESULT_INVALID and "not valid JSON" in bad.reason, bad.reason
    started = time.monotonic()
    fifo = run_job(ps_client, JobSpec(command="mkfifo /work/result.json", timeout=30))
    assert fifo.kind is FailureKind.RESULT_INVALID and "not a regular file" in fifo.reason, fifo.reason
    assert time.monotonic() - started < 10
    big = "python3 -c \"import json; json.dump(['x' * 2000000], open('/work/result.json', 'w'))\""
    large = run_job(ps_client, JobSpec(command=big, timeout=30))
    assert large.ok and large.result == ["x" * 2000000], large.reason
