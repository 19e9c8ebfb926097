"""The queue message format, without a broker: each malformed message names its field."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from pandastack_jobs.queue import DeadLetter, MessageError, parse
from pandastack_jobs.queue.message import MAX_JSON_DEPTH, json_depth


def _body(**doc: Any) -> bytes:
    return json.dumps(doc).encode()


def test_a_full_message_becomes_a_job_keyed_by_its_broker_id_and_delivery() -> None:
    raw = base64.b64encode(b"\x00\x01").decode()
    job = parse(
        _body(
            id="order-7",
            command="python3 run.py",
            tenant="acme",
            input={"n": 1},
            files={"run.py": "print(1)", "blob.bin": {"base64": raw}},
            options={"timeout": 9},
        ),
        "broker-id",
        defaults={"template": "base", "timeout": 30},
    )
    spec = job.spec("jobs", 3)
    assert job.message_id == "order-7" and spec.timeout == 9 and spec.template == "base"
    assert spec.files["/work/blob.bin"] == b"\x00\x01" and spec.input == {"n": 1}
    # The key is the broker's id of the message (the producer's id is only a correlation id).
    assert spec.key is not None and spec.key.run == "broker-id" and spec.key.try_number == 3
    assert spec.env["QUEUE_DELIVERY"] == "3" and spec.env["QUEUE_MESSAGE_ID"] == "order-7"
    assert spec.env["QUEUE_BROKER_ID"] == "broker-id"
    meta = spec.sandbox_metadata()
    assert meta["tenant"] == "acme" and meta["queue_message_id"] == "order-7"
    assert meta["queue_broker_id"] == "broker-id"
    assert parse(_body(command="true"), "1700-0").message_id == "1700-0"  # the broker's id


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"\xff\xfe", "body"),
        (b"[1, 2]", "body"),
        (b'{"command": "true", "input": NaN}', "body"),
        (_body(format="pandastack-job/2", command="true"), "format"),
        (_body(command="true", priority=1), "priority"),
        (_body(command=""), "command"),
        (_body(), "command"),
        (_body(command="true", id="a b"), "id"),
        (_body(command="true", tenant=7), "tenant"),
        (_body(command="true", files=["x"]), "files"),
        (_body(command="true", files={"x": 1}), "files['x']"),
        (_body(command="true", files={"x": {"base64": "%%"}}), "files['x'].base64"),
        (_body(command="true", files={"../x": "y"}), "files['../x']"),
        (_body(command="true", options=[]), "options"),
        (_body(command="true", options={"colour": 1}), "options.colour"),
        (_body(command="true", options={"timeout": 0}), "options.timeout"),
        (_body(command="true", options={"template": "../etc"}), "options.template"),
        (_body(command="true", options={"key": {}}), "options.key"),
        (_body(command="true", options={"env": {"A": 1, "1B": "x"}}), "options.env['1B']"),
    ],
)
def test_malformed_messages_name_their_field(body: bytes, field: str) -> None:
    with pytest.raises(MessageError) as err:
        parse(body, "b1")
    assert err.value.field == field, str(err.value)


def test_an_oversized_message_is_refused_before_it_is_read() -> None:
    with pytest.raises(MessageError, match="over the 100-byte limit") as err:
        parse(_body(command="true", input="x" * 200), "b1", max_bytes=100)
    assert err.value.field == "body"


@pytest.mark.parametrize(
    ("options", "defaults", "field"),
    [
        ({"max_result_bytes": 10**10}, {}, "options.max_result_bytes"),
        ({"max_file_bytes": 2048}, {"max_file_bytes": 1024}, "options.max_file_bytes"),
        ({"collect": [f"f{i}" for i in range(9)]}, {}, "options.collect"),
        ({"template": "code-interpreter"}, {"template": "base"}, "options.template"),
    ],
)
def test_a_message_cannot_raise_the_consumers_bounds(
    options: dict[str, Any], defaults: dict[str, Any], field: str
) -> None:
    """The producer may be a tenant: it may not make the consumer read more into its memory, nor
    pick a template outside the allowed ones."""
    with pytest.raises(MessageError) as err:
        parse(_body(command="true", options=options), "b1", defaults=defaults, allowed_templates={"base"})
    assert err.value.field == field, str(err.value)


def test_a_message_may_lower_the_bounds() -> None:
    job = parse(
        _body(command="true", options={"max_result_bytes": 100, "template": "base"}),
        "b1",
        defaults={"max_result_bytes": 1000},
        allowed_templates={"base"},
    )
    assert job.spec("q", 1).max_result_bytes == 100


def test_a_dead_letters_record_is_its_fields_in_order() -> None:
    """What the dead-letter destination stores beside the body: every field, in declaration order."""
    why = DeadLetter(
        "timed out", "timeout", None, 2, stdout_tail="out", stderr_tail="err", id="r-1", broker_id="5-0"
    )
    expected = {
        "reason": "timed out",
        "kind": "timeout",
        "field": None,
        "deliveries": 2,
        "stdout_tail": "out",
        "stderr_tail": "err",
        "id": "r-1",
        "broker_id": "5-0",
    }
    assert why.as_dict() == expected and list(why.as_dict()) == list(expected)
    assert why.to_json() == json.dumps(expected)


def test_two_messages_with_one_id_have_two_keys() -> None:
    """Same producer id (any tenant), two broker ids: two job ids, so reaping one delivery's
    earlier attempts can never touch the other's sandboxes."""
    a = parse(_body(id="order-42", command="true", tenant="victim"), "1-0").spec("jobs", 2)
    b = parse(_body(id="order-42", command="true", tenant="attacker"), "2-0").spec("jobs", 2)
    assert a.key is not None and b.key is not None and a.key.job_id != b.key.job_id


@pytest.mark.parametrize("levels", [65, 5_000, 200_000])
def test_nesting_past_the_depth_limit_is_refused_before_parsing(levels: int) -> None:
    body = b'{"command": "true", "input": ' + b"[" * levels + b"]" * levels + b"}"
    with pytest.raises(MessageError) as err:
        parse(body, "1-0")
    assert err.value.field == "body" and "MAX_JSON_DEPTH" in str(err.value)


def test_nesting_up_to_the_limit_and_brackets_in_strings_pass() -> None:
    deep: Any = []
    for _ in range(MAX_JSON_DEPTH - 3):  # with the message object and "input": the limit exactly
        deep = [deep]
    text = '[[[["\\ {{{{ \\\\'
    job = parse(_body(command="true", input={"deep": deep, "text": text}), "1-0")
    assert job.input["text"] == text
    assert json_depth(_body(command="true", input={"deep": deep}), 1000) == MAX_JSON_DEPTH
    assert json_depth(b"[" * 10_000, 64) == 65  # stops counting once past the limit


def test_metadata_the_consumer_writes_cannot_come_from_a_message() -> None:
    for name in ("queue_broker_id", "queue_chunk_job_abc", "tenant"):
        with pytest.raises(MessageError) as err:
            parse(_body(command="true", options={"metadata": {name: "x"}}), "1-0")
        assert err.value.field == f"options.metadata.{name}"


def test_the_key_scope_separates_one_row_id_in_two_tables() -> None:
    job = parse(_body(command="true"), "5")
    a, b = job.spec("jobs", 2, "table=a"), job.spec("jobs", 2, "table=b")
    assert a.key is not None and b.key is not None and a.key.job_id != b.key.job_id


@pytest.mark.parametrize("template", [".", "..", "builds"])
def test_a_template_name_that_is_another_route_of_the_templates_api_is_malformed(template: str) -> None:
    """Red team (issue 33): ``GET /v1/templates/<name>`` for these is not a template's answer (the
    list for ``.``, a 501 or the builds list for ``builds``), so a create's 5xx for them was never
    found to be an unknown template: ``.`` made run_job raise AttributeError (dead-lettered
    ``consumer_error``), ``builds`` was taken for a platform 5xx (uncharged, and pulling paused
    for every tenant, 10 times per message). Refused at parse, naming the field."""
    with pytest.raises(MessageError) as err:
        parse(_body(command="true", options={"template": template}), "1-0")
    assert err.value.field == "options.template"
