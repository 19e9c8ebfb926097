"""Redaction, guest command lines and function jobs: the texts that cross the wall."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from pandastack_jobs import JobArgumentsError, Redactor, function_job
from pandastack_jobs.guest import foreground_command, timed_out

KEY = "pds_" + "ab" * 16


def test_redactor_masks_known_secrets_and_token_shapes() -> None:
    r = Redactor(["hunter2-secret", None, "abc"])  # too-short secrets are ignored
    text = r(f"key={KEY} pw=hunter2-secret other=pds_{'0' * 32} abc")
    assert KEY not in text and "hunter2-secret" not in text and "pds_0000" not in text
    assert text.count("***") == 3 and text.endswith("abc")


def test_foreground_command_enforces_the_clock_in_the_guest() -> None:
    line = foreground_command("echo 'hi'; exit 3", 2.5, {"A": "x y"})
    assert "timeout -s TERM -k 5 2.5 sh -c" in line
    assert "A='x y'" in line
    # The quoted command survives a real shell round trip.
    prefix = "{ [ -d /work ] || mkdir -p /work; } && cd /work && "
    out = subprocess.run(["sh", "-c", line.replace(prefix, "")], capture_output=True)
    assert out.returncode == 3 and out.stdout == b"hi\n"


def test_timed_out_needs_both_the_code_and_the_clock() -> None:
    assert timed_out(124, 10.2, 10)
    assert timed_out(137, 15.0, 10)
    assert not timed_out(124, 1.0, 10)  # the job's own exit 124, early
    assert not timed_out(1, 20.0, 10)


def _double(x: int, *, scale: int = 2) -> dict:
    return {"value": x * scale}


def test_function_job_round_trip_as_plain_python(tmp_path) -> None:
    job = function_job(_double, [21], {"scale": 2})
    assert job["command"].startswith("python3 ")
    ((path, script),) = job["files"].items()
    assert "pickle" not in script
    # A chunk mate's layout: the job's own directory, named only by $JOB_WORKDIR, $JOB_INPUT and
    # $JOB_RESULT (guest.job_env); the command and the script follow them, not /work.
    (tmp_path / path.rsplit("/", 1)[1]).write_text(script)
    (tmp_path / "input.json").write_text(json.dumps(job["input"]))
    env = {
        "PATH": os.environ["PATH"],
        "JOB_WORKDIR": str(tmp_path),
        "JOB_INPUT": str(tmp_path / "input.json"),
        "JOB_RESULT": str(tmp_path / "result.json"),
    }
    subprocess.run(["sh", "-c", job["command"]], check=True, env=env, cwd="/")
    assert json.loads((tmp_path / "result.json").read_text()) == {"value": 42}


def test_function_job_refuses_non_json_arguments() -> None:
    with pytest.raises(JobArgumentsError) as info:
        function_job(_double, [object()])
    assert info.value.field == "args[0]"
    with pytest.raises(JobArgumentsError) as info:
        function_job(_double, [], {"scale": {1, 2}})
    assert info.value.field == "kwargs['scale']"


def test_function_job_refuses_lambdas() -> None:
    with pytest.raises(JobArgumentsError) as info:
        function_job(lambda: 1)
    assert "plain function" in str(info.value) or "source" in str(info.value)
