"""The Prefect entry points take a job's options from the core's declaration, typed for static
tools (``Unpack[...]`` of TypedDicts, no runtime signature rewriting), build the JobSpec once, and
read "left out" apart from ``None``. The worker and ``consume_queue`` declare nothing twice."""

from __future__ import annotations

import inspect
import typing
from typing import Any

import pytest
from typing_extensions import Unpack

import pandastack_jobs.spec
from pandastack_jobs import NOT_GIVEN, JobOptions, job_option, job_options, option_names
from pandastack_jobs.queue import CONSUMER_DEFAULTS
from pandastack_jobs.testing import FakeClient
from prefect_blocks import PandaStackSandbox, arun_in_sandbox, run_in_fork, run_in_sandbox, warm_pool
from prefect_blocks.queue import consume_queue
from prefect_blocks.sandbox import PREFECT_OPTIONS, SandboxOverrides
from prefect_blocks.tasks import CALL_ONLY, RunOptions, build_request
from prefect_blocks.worker import (
    PandaStackJobConfiguration,
    PandaStackWorker,
    PandaStackWorkerFields,
    PandaStackWorkerVariables,
)


def keys(typed: Any) -> list[str]:
    return list(typing.get_type_hints(typed))


def test_the_tasks_options_are_typed_kwargs_of_the_declaration() -> None:
    hints = typing.get_type_hints(JobOptions)
    assert keys(SandboxOverrides) == [*option_names(), *PREFECT_OPTIONS]
    assert keys(RunOptions) == [*option_names(), *PREFECT_OPTIONS, *CALL_ONLY]
    assert all(typing.get_type_hints(RunOptions)[n] == hints[n] for n in option_names())
    for fn in (run_in_sandbox.fn, arun_in_sandbox.fn, run_in_fork.fn, build_request):
        assert getattr(fn, "__signature__", None) is None, fn  # nothing rewritten at run time
        options = inspect.signature(fn).parameters["options"]
        assert options.kind is inspect.Parameter.VAR_KEYWORD
        assert typing.get_type_hints(fn, include_extras=True)["options"] == Unpack[RunOptions]
    request = typing.get_type_hints(PandaStackSandbox.request, include_extras=True)
    assert request["overrides"] == Unpack[SandboxOverrides]


def test_the_blocks_fields_are_the_declared_options_with_their_types() -> None:
    fields = PandaStackSandbox.model_fields
    for o in job_options():
        assert fields[o.name].description == o.doc, o.name
        assert (
            fields[o.name].annotation is not None and type(None) in typing.get_args(fields[o.name].annotation)
        ) is o.admits_none, o.name


def test_a_ttl_of_none_is_the_cores_none_and_left_out_is_the_blocks() -> None:
    block = PandaStackSandbox(
        command="x", timeout=50, ttl=900, result_path="out.json", concurrency_limit="cap"
    )
    assert block.request().spec.ttl == 900
    assert block.request(ttl=NOT_GIVEN, result_path=NOT_GIVEN).spec.ttl_seconds == 900
    dropped = block.request(ttl=None, result_path=None, concurrency_limit=None)
    assert (dropped.spec.ttl, dropped.spec.ttl_seconds, dropped.spec.result_path) == (None, 110, None)
    assert dropped.concurrency_limit is None  # None: no limit (it admits None)
    kept = block.request(timeout=None, publish_artifacts=None, concurrency_limit=NOT_GIVEN)
    assert (kept.spec.timeout, kept.publish_artifacts, kept.concurrency_limit) == (50, True, "cap")


def test_a_task_call_builds_the_jobspec_once(wired: FakeClient, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []
    original = pandastack_jobs.spec.JobSpec.__post_init__

    def counting(self: Any) -> None:
        built.append(self.command)
        original(self)

    monkeypatch.setattr(pandastack_jobs.spec.JobSpec, "__post_init__", counting)
    wired.script("job", result=1)
    assert run_in_sandbox.fn("job", timeout="9", ttl=None, env='{"K": 1}', publish_artifacts=False) == 1
    assert built == ["job"]
    call = wired.execs[-1]
    assert call.timeout == 9 and call.env["K"] == "1"


def test_unknown_options_and_a_forks_template_are_refused_naming_them(wired: FakeClient) -> None:
    with pytest.raises(TypeError, match=r"unknown sandbox option\(s\): \['cpus'\]"):
        run_in_sandbox.fn("job", cpus=4)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="template"):
        run_in_fork.fn(object(), "job", template="other")  # type: ignore[arg-type]
    assert wired.live() == []
    assert "parent_ttl" in inspect.signature(warm_pool).parameters


def test_the_worker_declares_its_fields_once() -> None:
    own = PandaStackWorkerFields.model_fields
    for model in (PandaStackJobConfiguration, PandaStackWorkerVariables):
        assert issubclass(model, PandaStackWorkerFields)
        for name, field in own.items():
            assert repr(model.model_fields[name]) == repr(field), (model.__name__, name)
    for name in ("template", "timeout", "ttl"):
        assert own[name].description.startswith(job_option(name).doc), name
    template = PandaStackWorker.get_default_base_job_template()
    properties = template["variables"]["properties"]
    assert set(own) <= set(properties) and properties["timeout"]["default"] == 3600.0
    assert {k: template["job_configuration"][k] for k in own} == {k: "{{ " + k + " }}" for k in own}


def test_consume_queue_takes_the_consumers_defaults() -> None:
    params = inspect.signature(consume_queue.fn).parameters
    names = [n for n in params if hasattr(CONSUMER_DEFAULTS, n)]
    assert set(names) >= {"concurrency", "max_deliveries", "lease_seconds", "max_messages"}
    for name in names:
        assert params[name].default == getattr(CONSUMER_DEFAULTS, name), name
