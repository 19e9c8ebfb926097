"""The Prefect entry points derive a job's options from the core's one declaration."""

from __future__ import annotations

import inspect
import logging
import typing

import pytest
from prefect import flow

from pandastack_jobs import job_options, option_names
from pandastack_jobs.lines import CONTINUED
from prefect_blocks import PandaStackSandbox, SandboxJobFailed, arun_in_sandbox, run_in_fork, run_in_sandbox
from prefect_blocks.execution import line_logger
from prefect_blocks.tasks import RunOptions


def test_block_fields_are_the_declared_options() -> None:
    fields = PandaStackSandbox.model_fields
    for o in job_options():
        assert o.name in fields, o.name
        assert fields[o.name].description == o.doc
        assert PandaStackSandbox().model_dump()[o.name] == (
            list(o.default) if isinstance(o.default, tuple) else o.default
        ), o.name


def test_task_signatures_are_derived_once() -> None:
    """The options are ``**options: Unpack[RunOptions]`` (typed from the declaration, no
    ``__signature__`` rewritten at run time): left out keeps the block's value."""
    sync = inspect.signature(run_in_sandbox.fn)
    assert inspect.signature(arun_in_sandbox.fn) == sync
    assert list(sync.parameters) == ["command", "files", "input", "options"]
    assert sync.parameters["options"].kind is inspect.Parameter.VAR_KEYWORD
    assert set(option_names()) <= set(typing.get_type_hints(RunOptions))
    fork = inspect.signature(run_in_fork.fn)
    assert list(fork.parameters)[:2] == ["parent", "command"]
    with pytest.raises(TypeError, match="template"):  # a fork is its parent's
        run_in_fork.fn(None, "true", template="other")
    with pytest.raises(TypeError, match="unknown sandbox option"):
        PandaStackSandbox().request("true", nope=1)


def test_an_option_reaches_the_job_from_a_task_call(credentials, local_server) -> None:
    """max_result_bytes was not an option of the Prefect entry points before; now every option is."""

    @flow
    def capped() -> str:
        block = PandaStackSandbox(credentials=credentials, publish_artifacts=False)
        return run_in_sandbox(
            'python3 -c \'import json; json.dump("x" * 1024, open("/work/result.json", "w"))\'',
            sandbox=block,
            timeout=60,
            max_result_bytes=100,
        )

    with pytest.raises(SandboxJobFailed, match="100-byte cap"):
        capped()
    assert local_server.client().sandboxes.list() == []


def test_overlong_lines_reach_the_log_whole_in_pieces(caplog: pytest.LogCaptureFixture) -> None:
    """Regression: Prefect's LineLogger kept only the last 2000 characters of a line still in the
    making, so the start of a long line arriving in several chunks was dropped silently."""
    log = logging.getLogger("test-pandastack-lines")
    lines = line_logger(log)
    long_line = "".join(chr(ord("a") + i % 26) for i in range(20_000))
    with caplog.at_level(logging.INFO, logger="test-pandastack-lines"):
        for start in range(0, len(long_line), 3000):
            lines("stdout", long_line[start : start + 3000])
        lines("stdout", "\n")
        lines.flush()
    pieces = [r.getMessage().removeprefix("[stdout] ") for r in caplog.records]
    assert "".join(p.removesuffix(CONTINUED) for p in pieces) == long_line
    assert all(p.endswith(CONTINUED) for p in pieces[:-1])
