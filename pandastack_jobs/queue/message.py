"""The queue message format (``pandastack-job/1``): one JSON object per message, checked field by field.

A message that cannot become a job is dead-lettered at once with a
:class:`MessageError` naming the field; it never reaches a sandbox and never
stops the consumer. See docs/queues.md for the format.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ..exceptions import JobSpecError, PandaStackJobsError
from ..options import coerce_options
from ..spec import DEFAULT_TEMPLATE, MAX_FILE_BYTES, MAX_RESULT_BYTES, Engine, JobKey, JobSpec
from .transport import one_line

FORMAT = "pandastack-job/1"
DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024
MAX_JSON_DEPTH = 64
"""How deeply a message's JSON may nest (objects and arrays), checked on the raw bytes before
parsing: Python's parser recurses per level, and 5,000 levels (10 KB) overflow its stack."""
MAX_COLLECT = 8  # collected files a message may ask for (each up to max_file_bytes, in memory)
FIELDS = frozenset({"format", "id", "command", "files", "input", "options", "tenant"})
ID_PATTERN = re.compile(r"^[A-Za-z0-9._:@/-]{1,128}$")
# Options a message may not set: the consumer owns the key (it names the delivery attempt).
_RESERVED_OPTIONS = frozenset({"key", "classifier"})
# Sandbox metadata the consumer writes (a message's options.metadata may not name it).
_RESERVED_METADATA = re.compile(r"^(queue_|tenant$)")
# What the depth scan looks at: brackets, quotes and backslashes (one character each).
_JSON_TOKENS = re.compile(rb'[\[\]{}"\\]')


class MessageError(PandaStackJobsError, ValueError):
    """A message is malformed, oversized or of an unknown format; ``field`` names the culprit."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = one_line(field, 120)  # a producer's key: printable and short in every log
        self.problem = problem
        super().__init__(f"{self.field}: {problem}")


@dataclass(frozen=True)
class QueueJob:
    """A parsed message: its correlation id (the producer's ``id``, else the broker's), the
    broker's own id of it, and how to build its job.

    ``message_id`` is only a correlation id for replies and logs: a producer chooses it, so two
    messages may share it. ``broker_id`` (:attr:`Delivery.message_id`) is what names, reaps and
    fences the message's sandboxes.
    """

    message_id: str
    command: str
    files: Mapping[str, bytes | str]
    input: Any
    options: Mapping[str, Any]
    tenant: str | None
    broker_id: str = ""

    def spec(self, queue: str, delivery: int, scope: str = "") -> JobSpec:
        """The job of delivery number ``delivery``: its key is the queue and the broker's id of the
        message (never the producer's ``id``), with the delivery as the try, so the next delivery
        of this very message reaps what a killed worker's attempt left and nothing else. The job
        sees ``$QUEUE_MESSAGE_ID`` (the correlation id), ``$QUEUE_BROKER_ID`` and ``$QUEUE_DELIVERY``.
        ``scope``: :attr:`Transport.key_scope` (two tables' row 5 are two messages)."""
        broker_id = self.broker_id or self.message_id
        task = f"message@{scope}" if scope else "message"
        key = JobKey(engine=Engine.QUEUE, workflow=queue, task=task, run=broker_id, try_number=delivery)
        meta = {"queue_message_id": self.message_id[:256], "queue_broker_id": broker_id[:256]}
        if self.tenant:
            meta["tenant"] = self.tenant[:256]
        options = dict(self.options)
        options["metadata"] = {**dict(options.get("metadata") or {}), **meta}
        queue_env = {
            "QUEUE_MESSAGE_ID": self.message_id,
            "QUEUE_BROKER_ID": broker_id,
            "QUEUE_DELIVERY": str(delivery),
        }
        options["env"] = {**dict(options.get("env") or {}), **queue_env}
        try:
            return JobSpec(command=self.command, files=self.files, input=self.input, key=key, **options)
        except JobSpecError as exc:
            raise MessageError(_option_field(exc.field), f"{exc.problem}; {exc.fix}") from None


def json_depth(body: bytes, limit: int) -> int:
    """How deeply ``body``'s JSON nests (objects and arrays), counted on the raw bytes without
    parsing, in one linear pass over the brackets, quotes and backslashes (brackets inside
    strings do not count); stops once past ``limit``. Invalid JSON is left to the parser."""
    depth = deepest = 0
    in_string = False
    escaped_at = -1  # the position a backslash in a string escapes
    for match in _JSON_TOKENS.finditer(body):
        pos, char = match.start(), match.group()
        if in_string:
            if pos == escaped_at:
                continue
            if char == b"\\":
                escaped_at = pos + 1
            elif char == b'"':
                in_string = False
        elif char == b'"':
            in_string = True
        elif char in (b"[", b"{"):
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif char in (b"]", b"}"):
            depth -= 1
    return deepest


def _option_field(name: str) -> str:
    return name if name in ("command", "files", "input") or name.startswith("files[") else f"options.{name}"


def parse(
    body: bytes,
    broker_id: str,
    *,
    defaults: Mapping[str, Any] | None = None,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    allowed_templates: Collection[str] | None = None,
) -> QueueJob:
    """Read one message body; raise :class:`MessageError` naming the field on anything wrong.

    ``defaults`` are job options the consumer applies (e.g. the template); the
    message's own ``options`` win, except that a message may lower but never raise the
    bounds on what the consumer reads back into its own memory (``max_result_bytes``,
    ``max_file_bytes``, the number of ``collect`` paths): the producer may be a tenant.
    ``allowed_templates``: the only templates a message may run on (None: any).
    ``broker_id`` (the broker's id of the message) names the job's sandboxes; it is also the
    correlation id when the message has no ``id``. Size and nesting depth are checked before
    the JSON is parsed.
    """
    if len(body) > max_bytes:
        raise MessageError("body", f"is {len(body)} bytes, over the {max_bytes}-byte limit")
    depth = json_depth(body, MAX_JSON_DEPTH)
    if depth > MAX_JSON_DEPTH:
        raise MessageError(
            "body", f"is nested more than {MAX_JSON_DEPTH} levels deep, over the limit (MAX_JSON_DEPTH)"
        )
    try:
        doc = json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise MessageError("body", f"is not UTF-8 JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise MessageError("body", f"is a JSON {type(doc).__name__}, not an object")
    fmt = doc.get("format", FORMAT)
    if fmt != FORMAT:
        raise MessageError("format", f"{_short(fmt)} is not a known format (this consumer reads {FORMAT!r})")
    unknown = sorted(set(doc) - FIELDS)
    if unknown:
        raise MessageError(unknown[0], f"is not a message field (fields: {', '.join(sorted(FIELDS))})")
    message_id = doc.get("id", broker_id)
    if not isinstance(message_id, str) or not ID_PATTERN.match(message_id):
        raise MessageError("id", f"{_short(message_id)} is not 1-128 characters of A-Z a-z 0-9 . _ : @ / -")
    command = doc.get("command")
    if not isinstance(command, str) or not command.strip():
        raise MessageError("command", "is missing or not a non-empty string")
    tenant = doc.get("tenant")
    if tenant is not None and (not isinstance(tenant, str) or not ID_PATTERN.match(tenant)):
        raise MessageError("tenant", f"{_short(tenant)} is not 1-128 characters of A-Z a-z 0-9 . _ : @ / -")
    options = doc.get("options", {})
    if not isinstance(options, dict):
        raise MessageError("options", "is not an object")
    for name in sorted(_RESERVED_OPTIONS & set(options)):
        raise MessageError(f"options.{name}", "is set by the consumer, not the message")
    metadata = options.get("metadata")
    if isinstance(metadata, dict):
        for name in sorted(k for k in metadata if isinstance(k, str) and _RESERVED_METADATA.match(k)):
            raise MessageError(f"options.metadata.{name}", "is sandbox metadata the consumer writes")
    try:
        floor = coerce_options(dict(defaults or {}))
        merged = coerce_options({**floor, **options})
    except JobSpecError as exc:
        raise MessageError(f"options.{exc.field}", f"{exc.problem}; {exc.fix}") from None
    _check_bounds(merged, floor, allowed_templates)
    files = _files(doc.get("files", {}))
    job = QueueJob(message_id, command, files, doc.get("input"), merged, tenant, broker_id)
    job.spec("check", 1)  # every remaining check of the job, before any sandbox exists
    return job


def _check_bounds(
    merged: Mapping[str, Any], floor: Mapping[str, Any], allowed_templates: Collection[str] | None
) -> None:
    for name, default in (("max_result_bytes", MAX_RESULT_BYTES), ("max_file_bytes", MAX_FILE_BYTES)):
        ceiling = floor.get(name, default)
        value = merged.get(name, ceiling)
        if isinstance(value, int) and value > ceiling:
            raise MessageError(f"options.{name}", f"{value} is over this consumer's limit of {ceiling} bytes")
    collect = merged.get("collect") or ()
    if len(collect) > MAX_COLLECT:
        raise MessageError("options.collect", f"has {len(collect)} paths, over the limit of {MAX_COLLECT}")
    template = merged.get("template", DEFAULT_TEMPLATE)
    if allowed_templates is not None and template not in allowed_templates:
        raise MessageError(
            "options.template",
            f"{template!r} is not allowed here (allowed: {', '.join(sorted(allowed_templates))})",
        )


def _files(value: Any) -> dict[str, bytes | str]:
    if not isinstance(value, dict):
        raise MessageError("files", 'is not an object of {"path": "text" | {"base64": "..."}}')
    out: dict[str, bytes | str] = {}
    for path, content in value.items():
        if isinstance(content, str):
            out[path] = content
        elif isinstance(content, dict) and set(content) == {"base64"} and isinstance(content["base64"], str):
            try:
                out[path] = base64.b64decode(content["base64"], validate=True)
            except (binascii.Error, ValueError):
                raise MessageError(f"files[{path!r}].base64", "is not valid base64") from None
        else:
            raise MessageError(f"files[{path!r}]", 'is neither text nor {"base64": "..."}')
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
