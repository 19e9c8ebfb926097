"""A job's options are declared once (JobSpec's option fields); JobOptions, the TypedDict static
tools read, and the consumer's settings are held to that declaration here."""

from __future__ import annotations

import copy
import inspect
import pickle
import typing
from dataclasses import dataclass, fields
from typing import Any

import pytest

from pandastack_jobs import (
    NOT_GIVEN,
    JobOptions,
    JobSpec,
    JobSpecError,
    NotGiven,
    coerce_options,
    given_options,
    job_options,
    merge_options,
)
from pandastack_jobs.queue import CONSUMER_DEFAULTS, Consumer, ConsumerSettings, batch_done, open_transport
from pandastack_jobs.spec import option


def declared(spec_class: type) -> dict[str, Any]:
    """The option fields of ``spec_class`` (a JobSpec), name → annotation, in order."""
    hints = typing.get_type_hints(spec_class)
    return {f.name: hints[f.name] for f in fields(spec_class) if "doc" in f.metadata}


def disagreement(typed: type, spec_class: type = JobSpec) -> list[str]:
    """Where ``typed`` (a TypedDict) and the declaration differ: missing, extra or retyped names."""
    want, have = declared(spec_class), typing.get_type_hints(typed)
    problems = [f"{n}: declared, not in {typed.__name__}" for n in want if n not in have]
    problems += [f"{n}: in {typed.__name__}, not declared" for n in have if n not in want]
    problems += [f"{n}: {have[n]} != {want[n]}" for n in want if n in have and have[n] != want[n]]
    if not problems and list(have) != list(want):
        problems.append(f"order {list(have)} != {list(want)}")
    return problems


def test_job_options_typed_dict_is_the_declaration() -> None:
    """Add an option to JobSpec and this fails until its line is in JobOptions, same type."""
    assert disagreement(JobOptions) == []
    assert list(typing.get_type_hints(JobOptions)) == [o.name for o in job_options()]
    assert JobOptions.__total__ is False  # every option may be left out


def test_an_option_added_only_to_the_declaration_is_caught() -> None:
    @dataclass(frozen=True)
    class Wider(JobSpec):
        cpus: int = option(1, doc="How many CPUs the sandbox gets.")

    assert disagreement(JobOptions, Wider) == ["cpus: declared, not in JobOptions"]

    class Retyped(JobOptions, total=False):
        timeout: int  # type: ignore[misc]

    assert disagreement(Retyped) == [f"timeout: {int} != {float}"]


def test_not_given_is_one_falsy_instance_that_survives_pickle_and_copy() -> None:
    assert NotGiven() is NOT_GIVEN and not NOT_GIVEN and repr(NOT_GIVEN) == "NOT_GIVEN"
    assert pickle.loads(pickle.dumps(NOT_GIVEN)) is NOT_GIVEN
    assert copy.deepcopy({"ttl": NOT_GIVEN})["ttl"] is NOT_GIVEN and copy.copy(NOT_GIVEN) is NOT_GIVEN
    assert NOT_GIVEN is not None


def test_none_is_a_value_only_where_the_declaration_admits_it() -> None:
    assert {o.name for o in job_options() if o.admits_none} == {"result_path", "ttl"}
    given = given_options({"ttl": None, "result_path": None, "timeout": None, "env": NOT_GIVEN})
    assert given == {"ttl": None, "result_path": None}  # timeout=None: left out, as before
    assert merge_options({"ttl": 900, "timeout": 50}, {"ttl": None, "timeout": None}) == {
        "ttl": None,
        "timeout": 50,
    }
    assert merge_options({"ttl": 900}, {"ttl": NOT_GIVEN}) == {"ttl": 900}
    spec = JobSpec(command="x", timeout=50, **coerce_options(merge_options({"ttl": 900}, {"ttl": None})))
    assert spec.ttl is None and spec.ttl_seconds == 110  # None: what JobSpec says (timeout + 60)


def test_coerce_options_leaves_not_given_out_and_still_names_unknown_ones() -> None:
    assert coerce_options({"timeout": "30", "ttl": NOT_GIVEN}) == {"timeout": 30}
    with pytest.raises(JobSpecError) as info:
        coerce_options({"cpus": 2, "ttl": NOT_GIVEN})
    assert info.value.field == "cpus"


def test_the_consumer_takes_its_defaults_from_its_settings() -> None:
    params = inspect.signature(Consumer.__init__).parameters
    own = {f.name for f in fields(ConsumerSettings)} & set(params)
    assert own == {
        "concurrency",
        "max_deliveries",
        "release_delay",
        "drain_seconds",
        "chunk_size",
        "chunk_key",
        "chunk_keyless",
    }
    for name in own:
        assert params[name].default == getattr(CONSUMER_DEFAULTS, name), name
    assert inspect.signature(open_transport).parameters["lease_seconds"].default == 60.0
    assert CONSUMER_DEFAULTS.lease_seconds == 60.0 and callable(batch_done(1, 0.0))


def test_the_consume_command_takes_its_defaults_from_the_consumer_settings() -> None:
    from pandastack_jobs.queue.cli import _parser

    args = _parser().parse_args(["consume", "--broker", "redis://localhost/0"])
    flags = {
        "concurrency": "concurrency",
        "lease": "lease_seconds",
        "max_deliveries": "max_deliveries",
        "release_delay": "release_delay",
        "drain": "drain_seconds",
        "chunk_size": "chunk_size",
        "chunk_key": "chunk_key",
        "chunk_keyless": "chunk_keyless",
    }
    assert {f: getattr(args, f) for f in flags} == {
        f: getattr(CONSUMER_DEFAULTS, s) for f, s in flags.items()
    }
