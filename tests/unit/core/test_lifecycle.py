"""The one lifecycle (create → deliver → exec → collect → delete) against the in-memory PandaStack.

Each test states one rule of pandastack_jobs.lifecycle and checks it through the SDK's
own objects; the real-server versions of the happy paths are in tests/jobs.
"""

from __future__ import annotations

import json
import threading
import time
import tracemalloc

import pandastack
import pytest
import requests

from pandastack_jobs import FailureClass, FailureKind, JobHandle, JobKey, JobSpec, run_job
from pandastack_jobs.spec import INPUT_PATH, MANAGED_BY, RESULT_PATH, TTL_MARGIN_SECONDS
from pandastack_jobs.testing import FakeClient, Script


def test_success_delivers_files_and_input_reads_the_result_and_deletes_the_sandbox(fake: FakeClient) -> None:
    seen: dict[str, bytes] = {}

    def job(sb: object, call: object) -> None:
        seen.update(fake.sandbox(sb.id).files)  # type: ignore[attr-defined]

    fake.script("python3 run.py", Script(action=job, result={"rows": 3}, stdout="done\n"))
    outcome = run_job(
        fake, JobSpec(command="python3 run.py", files={"run.py": "print(1)"}, input={"n": 2}, timeout=30)
    )
    assert outcome.ok and outcome.result == {"rows": 3} and outcome.has_result
    assert outcome.stdout_tail == "done\n"
    assert seen == {"/work/run.py": b"print(1)", INPUT_PATH: b'{"n": 2}'}
    assert fake.live() == [] and fake.deleted == [outcome.sandbox_id]
    call = fake.execs[-1]
    assert call.command == "python3 run.py" and call.timeout == 30
    assert call.env["JOB_RESULT"] == RESULT_PATH and call.stream
    assert (
        call.timeout_seconds is not None and call.timeout_seconds > 30
    )  # the server's clock is the 2nd rail


def test_the_sandbox_gets_the_ttl_backstop_and_the_attempts_metadata(fake: FakeClient) -> None:
    created: list[dict[str, str]] = []
    fake.script("true", Script(action=lambda sb, call: created.append(dict(sb.metadata)) and None, result=1))
    key = JobKey(engine="unit", workflow="w", task="t", run="r", try_number=2)
    spec = JobSpec(command="true", timeout=100, key=key, metadata={"job_try": "99", "team": "a"})
    run_job(fake, spec)
    meta = created[0]
    assert meta["team"] == "a" and meta["job_try"] == "2"  # the attempt's own keys win
    assert meta["managed_by"] == MANAGED_BY and meta["job_id"] == key.job_id
    assert spec.ttl_seconds == 100 + TTL_MARGIN_SECONDS


def test_a_non_zero_exit_is_redelivered_with_the_last_stderr_line(fake: FakeClient) -> None:
    fake.script("crash", exit_code=1, stderr="warming up\nValueError: bad row 7\n")
    outcome = run_job(fake, JobSpec(command="crash"))
    assert not outcome.ok and outcome.kind is FailureKind.EXIT_CODE and outcome.redeliver
    assert outcome.reason == "job failed with exit code 1: ValueError: bad row 7"
    assert outcome.exit_code == 1 and fake.live() == []


def test_a_permanent_exit_code_is_dead_lettered(fake: FakeClient) -> None:
    fake.script("validate", exit_code=3)
    outcome = run_job(fake, JobSpec(command="validate", permanent_exit_codes=[3]))
    assert outcome.kind is FailureKind.PERMANENT_EXIT_CODE and outcome.dead_letter


def test_a_signal_exit_names_the_signal(fake: FakeClient) -> None:
    fake.script("oom", exit_code=137)
    outcome = run_job(fake, JobSpec(command="oom"))
    assert "SIGKILL" in outcome.reason and outcome.kind is FailureKind.EXIT_CODE


def test_a_job_killed_by_the_guest_clock_is_a_timeout(fake: FakeClient) -> None:
    fake.script("sleep", hangs=True)
    outcome = run_job(fake, JobSpec(command="sleep", timeout=0.05))
    assert outcome.kind is FailureKind.TIMEOUT and outcome.redeliver
    assert "0.05s timeout" in outcome.reason
    fake.script("sleep", hangs=True)
    assert run_job(fake, JobSpec(command="sleep", timeout=0.05, retry_on_timeout=False)).dead_letter


def test_exit_124_before_the_deadline_is_an_ordinary_exit(fake: FakeClient) -> None:
    fake.script("own124", exit_code=124)
    assert run_job(fake, JobSpec(command="own124", timeout=60)).kind is FailureKind.EXIT_CODE


@pytest.mark.parametrize(
    ("script", "kind"),
    [
        (Script(), FailureKind.RESULT_MISSING),
        (Script(raw_result=b"{not json"), FailureKind.RESULT_INVALID),
        (Script(raw_result=b'{"x": NaN}'), FailureKind.RESULT_INVALID),
        (Script(raw_result=b"\xff\xfe"), FailureKind.RESULT_INVALID),
        (Script(raw_result=b"1" * 101), FailureKind.RESULT_TOO_LARGE),
    ],
)
def test_a_bad_result_is_dead_lettered(fake: FakeClient, script: Script, kind: FailureKind) -> None:
    fake.script("job", script)
    outcome = run_job(fake, JobSpec(command="job", max_result_bytes=100))
    assert outcome.kind is kind and outcome.failure_class is FailureClass.DEAD_LETTER
    assert fake.live() == []


@pytest.mark.parametrize("max_result_bytes", [10**5, 2 * 1024 * 1024])  # the trailer, then the read
def test_a_deeply_nested_result_is_invalid_not_a_crash(fake: FakeClient, max_result_bytes: int) -> None:
    # 20 KB of brackets is past the JSON decoder's recursion limit: a RecursionError from a job's
    # bytes must come back as the job's dead letter, not out of run_job as a bug (the queue
    # consumer redelivered it as a consumer error).
    depth = max_result_bytes // 5
    fake.script("job", Script(raw_result=b"[" * depth + b"]" * depth))
    outcome = run_job(fake, JobSpec(command="job", max_result_bytes=max_result_bytes))
    assert outcome.kind is FailureKind.RESULT_INVALID and "too deeply nested" in outcome.reason
    assert outcome.failure_class is FailureClass.DEAD_LETTER and fake.live() == []


def test_a_result_that_is_not_a_regular_file_is_never_read(fake: FakeClient) -> None:
    def fifo(sb: object, call: object) -> None:
        fake.sandbox(sb.id).kinds[RESULT_PATH] = "p"  # type: ignore[attr-defined]

    fake.script("job", Script(action=fifo))
    outcome = run_job(fake, JobSpec(command="job"))
    assert outcome.kind is FailureKind.RESULT_INVALID and "not a regular file" in outcome.reason
    assert [r for r in fake.requests if r[0] == "GET" and r[1].endswith("/fs")] == []  # never read


def test_no_result_path_means_no_result_and_collected_files_come_back(fake: FakeClient) -> None:
    fake.script("report", files={"/work/report.md": "# ok"})
    outcome = run_job(fake, JobSpec(command="report", result_path=None, collect=["report.md"]))
    assert outcome.ok and not outcome.has_result and outcome.result is None
    assert dict(outcome.files) == {"/work/report.md": b"# ok"}


def test_a_missing_collected_file_is_dead_lettered(fake: FakeClient) -> None:
    fake.script("report", result=1)
    outcome = run_job(fake, JobSpec(command="report", collect=["missing.csv"]))
    assert outcome.kind is FailureKind.RESULT_MISSING and "/work/missing.csv" in outcome.reason


def test_a_file_over_the_upload_limit_is_refused_before_it_is_sent(fake: FakeClient) -> None:
    outcome = run_job(fake, JobSpec(command="true", files={"big.bin": b"x" * 11}, max_file_bytes=10))
    assert outcome.kind is FailureKind.BAD_REQUEST and "over the 10-byte" in outcome.reason
    assert fake.execs == [] and fake.live() == []


def test_a_failed_delete_after_success_is_reported_not_a_failure(
    fake: FakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    fake.script("ok", result=True)
    fake.fail("delete", pandastack.ServerError("agent unreachable"))
    outcome = run_job(fake, JobSpec(command="ok"))
    assert outcome.ok and outcome.teardown_error == "ServerError: agent unreachable"
    assert "TTL will reap it" in caplog.text and fake.live() == [outcome.sandbox_id]


def test_a_bug_in_a_callback_propagates_and_still_deletes(fake: FakeClient) -> None:
    def on_created(sandbox_id: str) -> None:
        raise ZeroDivisionError("callback bug")

    with pytest.raises(ZeroDivisionError):
        run_job(fake, JobSpec(command="true"), on_created=on_created)
    assert fake.live() == [] and len(fake.deleted) == 1


def test_an_interrupt_mid_job_deletes_the_sandbox_and_propagates(fake: FakeClient) -> None:
    def interrupt(sb: object, call: object) -> None:
        raise KeyboardInterrupt

    fake.script("long", Script(action=interrupt))
    with pytest.raises(KeyboardInterrupt):
        run_job(fake, JobSpec(command="long"))
    assert fake.live() == [] and len(fake.deleted) == 1


def test_cancel_from_another_thread_deletes_the_sandbox_and_dead_letters(fake: FakeClient) -> None:
    release = threading.Event()
    fake.script("long", wait=release)
    handle = JobHandle()
    done: list[object] = []
    worker = threading.Thread(
        target=lambda: done.append(run_job(fake, JobSpec(command="long"), handle=handle)), daemon=True
    )
    worker.start()
    try:
        deadline = time.monotonic() + 5
        while handle.sandbox_id is None or not fake.execs:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        handle.cancel()
        worker.join(5)
    finally:
        release.set()  # a cancel that did not stop the job must not hang the run
    assert done, "the job did not end when cancelled"
    outcome = done[0]
    assert outcome.kind is FailureKind.CANCELLED and outcome.dead_letter  # type: ignore[attr-defined]
    assert fake.live() == []


def test_cancel_before_create_deletes_the_sandbox_at_once(fake: FakeClient) -> None:
    handle = JobHandle()
    handle.cancel()
    outcome = run_job(fake, JobSpec(command="true"), handle=handle)
    assert outcome.kind is FailureKind.CANCELLED and fake.execs == [] and fake.live() == []


def test_output_streams_to_the_callback_redacted_and_the_key_never_reaches_the_sandbox(
    fake: FakeClient,
) -> None:
    assert fake.api_key
    fake.script("leak", stdout=["a ", f"key={fake.api_key}\n"], result=1)
    chunks: list[tuple[str, str]] = []
    outcome = run_job(
        fake, JobSpec(command="leak", env={"TZ": "UTC"}), on_output=lambda s, c: chunks.append((s, c))
    )
    assert chunks[0] == ("stdout", "a ") and fake.api_key not in "".join(c for _, c in chunks)
    assert fake.api_key not in outcome.stdout_tail and "***" in outcome.stdout_tail
    assert all(fake.api_key not in call.line for call in fake.execs)
    assert fake.execs[-1].env["TZ"] == "UTC"


def test_the_output_tail_keeps_the_end(fake: FakeClient) -> None:
    fake.script("chatty", stdout=[f"line {i}\n" for i in range(3000)], result=1)
    outcome = run_job(fake, JobSpec(command="chatty"))
    assert outcome.stdout_tail.endswith("line 2999\n") and len(outcome.stdout_tail) <= 8 * 1024


def test_input_is_delivered_as_json_and_nan_is_refused_before_any_sandbox(fake: FakeClient) -> None:
    seen: list[bytes] = []
    fake.script("j", Script(action=lambda sb, call: seen.append(sb.files[INPUT_PATH]) and None, result=1))
    run_job(fake, JobSpec(command="j", input=[1, "x"]))
    assert json.loads(seen[0]) == [1, "x"]
    with pytest.raises(ValueError, match="input"):
        JobSpec(command="j", input=float("nan"))


# -- SDK errors, by step: what each becomes -----------------------------------------------------


@pytest.mark.parametrize(
    ("op", "error", "kind"),
    [
        ("create", pandastack.AuthError("invalid api token"), FailureKind.AUTH),
        ("create", pandastack.APIConnectionError("refused"), FailureKind.CONNECTION),
        ("create", pandastack.BadRequestError("metadata must be a map"), FailureKind.BAD_REQUEST),
        ("create", pandastack.ServerError("boom"), FailureKind.SERVER_ERROR),
        ("create", pandastack.CreateCancelled("cancelled"), FailureKind.CANCELLED),
        ("write", pandastack.APIConnectionError("reset"), FailureKind.SANDBOX_LOST),
        ("write", pandastack.NotFoundError("not found"), FailureKind.SANDBOX_LOST),
        ("exec_stream", pandastack.ServerError("context deadline exceeded"), FailureKind.SERVER_ERROR),
        ("exec_stream", requests.ConnectionError("reset by peer"), FailureKind.SANDBOX_LOST),
        ("stat", pandastack.AuthError("invalid api token"), FailureKind.AUTH),
    ],
)
def test_sdk_errors_become_failure_kinds(
    fake: FakeClient, op: str, error: Exception, kind: FailureKind
) -> None:
    fake.script("job", result=1)
    fake.fail(op, error)
    # A binary file still goes by PUT (write) and a collected file is stat'ed (stat).
    outcome = run_job(fake, JobSpec(command="job", files={"a": b"\x00b"}, collect=["a"]))
    assert outcome.kind is kind, outcome.reason
    assert fake.live() == []


def test_an_unknown_template_is_dead_lettered_naming_it(fake: FakeClient) -> None:
    outcome = run_job(fake, JobSpec(command="true", template="no-such"))
    assert outcome.kind is FailureKind.UNKNOWN_TEMPLATE and outcome.dead_letter
    assert "'no-such'" in outcome.reason


def test_a_capacity_refusal_is_redelivered_after_the_servers_retry_after() -> None:
    from pandastack_jobs.connection import _record_refusal

    fake = FakeClient(max_create_retry_seconds=1, on_create_retry=_record_refusal)
    fake.refuse_capacity(retry_after=7)
    outcome = run_job(fake, JobSpec(command="true"))
    assert outcome.kind is FailureKind.CAPACITY and outcome.redeliver and outcome.retry_after == 7


def test_a_capacity_refusal_unseen_by_the_sdk_waits_the_wires_retry_after(fake: FakeClient) -> None:
    fake.refuse_capacity(retry_after=None)
    outcome = run_job(fake, JobSpec(command="true"))
    assert outcome.kind is FailureKind.CAPACITY and outcome.retry_after == 5.0


def test_a_stream_without_an_exit_is_a_lost_sandbox_never_a_success(fake: FakeClient) -> None:
    fake.script("job", result=1, stream_ends="eof")
    outcome = run_job(fake, JobSpec(command="job"))
    assert outcome.kind is FailureKind.SANDBOX_LOST and outcome.redeliver and not outcome.ok


def test_a_job_printing_without_end_costs_run_job_only_its_tail(fake: FakeClient) -> None:
    # The SDK's exec_stream keeps every chunk: 200 MB printed by a job cost run_job 228 MB.
    chunk = "a" * 65536
    fake.script("job", stdout=[chunk] * 512, stderr=[chunk] * 256, result=1)  # 48 MiB of output
    tracemalloc.start()
    try:
        outcome = run_job(fake, JobSpec(command="job"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert outcome.ok and outcome.result == 1 and outcome.stdout_tail.endswith("a" * 1000)
    assert peak < 8 * 1024 * 1024, f"run_job held {peak} bytes of a 48 MiB output"


def test_a_dropped_stream_is_a_lost_sandbox(fake: FakeClient) -> None:
    fake.script("job", result=1, stream_ends="drop")
    assert run_job(fake, JobSpec(command="job")).kind is FailureKind.SANDBOX_LOST


def test_a_5xx_from_a_dead_sandbox_is_a_lost_sandbox_and_from_a_live_one_a_server_error(
    fake: FakeClient,
) -> None:
    def die(sb: object, call: object) -> None:
        fake.lose(sb.id)  # type: ignore[attr-defined]

    fake.script("job", Script(action=die, result=1))
    assert run_job(fake, JobSpec(command="job")).kind is FailureKind.SANDBOX_LOST
    fake.script("job", result=1, files={"/work/out.csv": "a"})
    fake.fail("stat", pandastack.ServerError("disk error"))
    assert run_job(fake, JobSpec(command="job", collect=["out.csv"])).kind is FailureKind.SERVER_ERROR


def test_a_sandbox_deleted_under_the_result_read_is_lost_not_missing(fake: FakeClient) -> None:
    def vanish(sb: object, call: object) -> None:
        fake.expire(sb.id)  # type: ignore[attr-defined]

    fake.script("job", Script(action=vanish))
    assert run_job(fake, JobSpec(command="job")).kind is FailureKind.SANDBOX_LOST


def test_background_output_inside_the_trailer_falls_back_to_the_file(fake: FakeClient, monkeypatch) -> None:
    """A job's background process can write between the trailer's marks: the fast answer no
    longer decodes, so the result file itself is read and judged (found by a red-team pass)."""
    played = fake._trailer

    def mixed(sb, trailer):  # what a background writer does to the guest's stdout
        opening, data, closing = played(sb, trailer)
        return [opening, data, "bg says hi\n", closing]

    monkeypatch.setattr(fake, "_trailer", mixed)
    fake.script("job", result={"a": 1})
    outcome = run_job(fake, JobSpec(command="job"))
    assert outcome.ok and outcome.result == {"a": 1}, outcome.reason
