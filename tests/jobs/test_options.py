"""A job's options, declared once on JobSpec; copies that keep them; the core API adapters use."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pandastack
import pytest

from pandastack_jobs import (
    Classifier,
    DetachedJob,
    FailureKind,
    JobHandle,
    JobSpec,
    JobSpecError,
    LineSplitter,
    WarmPool,
    WarmupFailed,
    coerce_options,
    finish_detached,
    job_option,
    job_options,
    options_table,
    start_detached,
    validate_options,
)
from pandastack_jobs.lines import CONTINUED

ROOT = Path(__file__).resolve().parents[2]
TABLE = re.compile(r"<!-- job-options:start -->\n(.*?)\n<!-- job-options:end -->", re.S)


def test_every_option_is_a_documented_jobspec_field_with_its_default() -> None:
    spec = JobSpec(command="true")
    names = [o.name for o in job_options()]
    assert names[:3] == ["result_path", "collect", "template"] and "max_file_bytes" in names
    assert len(names) == len(set(names))
    for o in job_options():
        assert o.doc.endswith(".") and len(o.doc) > 20, o.name
        assert getattr(JobSpec(command="true", **{o.name: o.default}), o.name) == getattr(spec, o.name)
    assert job_option("collect").default is not job_option("metadata").default


@pytest.mark.parametrize("doc", ["README.md", "docs/airflow.md", "docs/prefect.md"])
def test_docs_parameter_tables_are_the_declaration(doc: str) -> None:
    """The docs' option table is generated from the declaration (options_table()); edit JobSpec, then
    paste ``python -c 'import pandastack_jobs as j; print(j.options_table())'`` between the markers."""
    tables = TABLE.findall((ROOT / doc).read_text())
    assert tables, f"{doc} has no <!-- job-options:start --> table"
    for table in tables:
        assert table == options_table(), f"{doc}'s option table is stale: regenerate it"


@pytest.mark.parametrize(
    ("name", "text", "value"),
    [
        ("collect", "['a.md', 'b.md']", ["a.md", "b.md"]),  # Jinja renders a list as its repr
        ("collect", '["a.md"]', ["a.md"]),
        ("collect", "", []),
        ("env", "{'A': 1, 'B': True}", {"A": "1", "B": "True"}),
        ("metadata", '{"team": "data"}', {"team": "data"}),
        ("permanent_exit_codes", "[3, 4]", [3, 4]),
        ("timeout", "30", 30),
        ("ttl", "600", 600),
        ("retry_on_timeout", "False", False),
        ("template", "123", "123"),
    ],
)
def test_values_that_arrived_as_text_are_read_back(name: str, text: str, value: object) -> None:
    assert coerce_options({name: text}) == {name: value}


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"collect": "report.md"}, "collect"),
        ({"env": "A=1"}, "env"),
        ({"env": "{'A': __import__('os')}"}, "env"),  # literals only, never code
        ({"collect": {"a": 1}}, "collect"),
        ({"nope": 1}, "nope"),
        ({"timeout": "soon"}, "timeout"),
        ({"permanent_exit_codes": [0]}, "permanent_exit_codes"),
        ({"retry_on_timeout": "maybe"}, "retry_on_timeout"),
    ],
)
def test_bad_option_values_name_the_field(values: dict, field: str) -> None:
    with pytest.raises(JobSpecError) as info:
        validate_options(values)
    assert info.value.field == field


def test_copies_keep_every_option_and_the_classifier() -> None:
    spec = JobSpec(command="true", permanent_exit_codes=[3], retry_on_timeout=False, max_file_bytes=10)
    copy = dataclasses.replace(spec, ttl=900)
    assert copy.classifier == spec.classifier and copy.max_file_bytes == 10 and copy.ttl == 900
    custom = Classifier(permanent_exit_codes=frozenset({5}))
    assert JobSpec(command="true", classifier=custom).permanent_exit_codes == frozenset({5})
    with pytest.raises(JobSpecError, match="classifier"):
        JobSpec(command="true", classifier=custom, permanent_exit_codes=[3])


def test_warm_pool_parent_keeps_the_size_caps(ps_client: pandastack.Client) -> None:
    """Regression: WarmPool.start_parent copied the spec field by field and dropped
    max_result_bytes/max_file_bytes, so a warm-up's 1 KiB result passed a 100-byte cap."""
    warmup = JobSpec(
        command='python3 -c \'import json; json.dump("x" * 1024, open("/work/result.json", "w"))\'',
        timeout=30,
        max_result_bytes=100,
    )
    with pytest.raises(WarmupFailed) as info:
        WarmPool(ps_client, warmup).start_parent()
    assert info.value.outcome.kind is FailureKind.RESULT_TOO_LARGE
    assert "100-byte cap" in info.value.outcome.reason


def test_line_splitter_cuts_overlong_lines_and_drops_nothing() -> None:
    seen: list[tuple[str, str]] = []
    lines = LineSplitter(lambda s, line: seen.append((s, line)), max_chars=10)
    long_line = "".join(str(i % 10) for i in range(25))
    for chunk in (long_line[:4], long_line[4:17], long_line[17:] + "\nnext\r\n", "tail"):
        lines("stdout", chunk)
    lines("stderr", "err")
    lines.flush()
    out = [line for s, line in seen if s == "stdout"]
    assert out == [long_line[:10] + CONTINUED, long_line[10:20] + CONTINUED, long_line[20:], "next", "tail"]
    assert "".join(line.removesuffix(CONTINUED) for line in out[:3]) == long_line
    assert ("stderr", "err") in seen


def test_line_splitter_says_when_it_stops_logging() -> None:
    seen: list[str] = []
    lines = LineSplitter(lambda s, line: seen.append(line), max_lines=2)
    lines("stdout", "a\nb\nc\nd\n")
    assert seen[:2] == ["a", "b"] and len(seen) == 3 and "not logged" in seen[2]


def test_detached_jobs_are_cancelled_through_their_handle(ps_client: pandastack.Client) -> None:
    spec = JobSpec(command="sleep 60", timeout=90)
    handle = JobHandle()
    started = start_detached(ps_client, spec, handle=handle)
    assert isinstance(started, DetachedJob) and handle.sandbox_id == started.sandbox_id
    handle.cancel()  # an operator's on_kill while the job is being started
    assert handle.sandbox_id not in {sb.id for sb in ps_client.sandboxes.list()}

    started = start_detached(ps_client, spec)
    assert isinstance(started, DetachedJob)
    finishing = JobHandle()
    finishing.cancel()  # killed before finishing: the sandbox goes as soon as it is attached
    outcome = finish_detached(ps_client, spec, started, handle=finishing)
    assert outcome.kind is FailureKind.CANCELLED and not outcome.ok
    assert ps_client.sandboxes.list() == []
