"""JobSpec validation: bad input fails before any sandbox exists, naming the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from pandastack_jobs import Classifier, JobKey, JobSpec, JobSpecError


def test_defaults_and_derived_ttl() -> None:
    spec = JobSpec(command="python3 run.py", timeout=120)
    assert spec.template == "code-interpreter"
    assert spec.result_path == "/work/result.json"
    assert spec.ttl_seconds == 180  # timeout + margin: the backstop outlasts the job's clock
    assert JobSpec(command="true", timeout=0.5).ttl_seconds == 61


def test_relative_paths_land_in_workdir() -> None:
    spec = JobSpec(command="true", files={"run.py": "print(1)", "/opt/x": b"y"}, collect=["out/report.md"])
    assert set(spec.files) == {"/work/run.py", "/opt/x"}
    assert spec.collect == ("/work/out/report.md",)


@pytest.mark.parametrize(
    ("kwargs", "field", "fix"),
    [
        ({"command": "  "}, "command", "shell command"),
        ({"template": "bad name!"}, "template", "A-Z"),
        ({"timeout": 0}, "timeout", "seconds"),
        ({"timeout": float("inf")}, "timeout", "seconds"),
        ({"timeout": 60, "ttl": 30}, "ttl", "longer than the timeout"),
        ({"files": {"../../etc/passwd": "x"}}, "files['../../etc/passwd']", "without '..'"),
        ({"files": {"a.txt": 3}}, "files['a.txt']", "bytes, str"),
        ({"files": {"a": Path("/nonexistent/file")}}, "files['a']", "check the path"),
        ({"input": {"when": object()}}, "input", "dicts, lists"),
        ({"input": float("nan")}, "input", "dicts, lists"),
        ({"collect": "report.md"}, "collect", "list of paths"),
        ({"result_path": "/work/../x"}, "result_path", "without '..'"),
        ({"env": {"1BAD": "x"}}, "env['1BAD']", "[A-Za-z_]"),
        ({"metadata": {"k": 1}}, "metadata['k']", "str()"),
        ({"max_result_bytes": 0}, "max_result_bytes", "bytes"),
    ],
)
def test_bad_input_names_field_and_fix(kwargs: dict, field: str, fix: str) -> None:
    kwargs = {"command": "true", **kwargs}
    with pytest.raises(JobSpecError) as info:
        JobSpec(**kwargs)
    assert info.value.field == field
    assert fix in str(info.value)


def test_spec_is_immutable() -> None:
    spec = JobSpec(command="true", files={"a": "b"}, metadata={"k": "v"})
    with pytest.raises(AttributeError):
        spec.command = "false"  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.files["c"] = "d"  # type: ignore[index]


def test_permanent_exit_codes_validated() -> None:
    with pytest.raises(JobSpecError) as info:
        Classifier(permanent_exit_codes=frozenset({0}))
    assert info.value.field == "permanent_exit_codes"


def test_job_key_is_stable_across_tries_and_names_the_attempt() -> None:
    first = JobKey("airflow", "dag", "task", "run1", map_index=3, try_number=1)
    second = JobKey("airflow", "dag", "task", "run1", map_index=3, try_number=2)
    other = JobKey("airflow", "dag", "task", "run1", map_index=4, try_number=1)
    assert first.job_id == second.job_id != other.job_id
    assert first.run_id == other.run_id
    meta = second.metadata()
    assert meta["job_try"] == "2" and meta["job_map_index"] == "3" and meta["managed_by"]
    assert all(isinstance(v, str) for v in meta.values())
    spec = JobSpec(command="true", key=second, metadata={"job_try": "99", "tenant": "acme"})
    assert spec.sandbox_metadata()["job_try"] == "2"  # the attempt's tags win over the user's
    assert spec.sandbox_metadata()["tenant"] == "acme"
