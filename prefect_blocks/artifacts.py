"""Turning a job's outcome into Prefect artifacts.

- a JSON list-of-records result → a table artifact (rows capped);
- a collected ``.md``/``.markdown``/``.html``/``.htm`` file → a markdown artifact (size capped);
- any other collected file → stored (a configured directory, else Prefect's
  result storage) and published as a link artifact;
- a dead-lettered job → a markdown artifact recording what failed and why, keyed per
  task run (``<name>-dead-letter-<task run id>``).

Keys follow Prefect's rules (lowercase letters, digits, dashes). Every text is
passed through the job's redactor first: the API key, and anything shaped like
a PandaStack token, never reaches an artifact.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any, Optional

from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.context import TaskRunContext

from pandastack_jobs import JobOutcome

from .keys import artifact_key
from .settings import PandaStackSettings, get_settings

logger = logging.getLogger(__name__)

MARKDOWN_SUFFIXES = (".md", ".markdown")
HTML_SUFFIXES = (".html", ".htm")
CELL_MAX_CHARS = 1000
DESCRIPTION_MAX_CHARS = 500

Redact = Callable[[str], str]


def is_records(value: Any) -> bool:
    """True for a non-empty JSON list of objects (a table)."""
    return isinstance(value, list) and bool(value) and all(isinstance(row, dict) for row in value)


def _cell(value: Any, redact: Redact) -> Any:
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = redact(text)
    return text if len(text) <= CELL_MAX_CHARS else text[: CELL_MAX_CHARS - 1] + "…"


def _clip(text: str, limit: int, what: str) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n\n*… {what} cut at {limit} characters ({len(text)} in all).*\n"


def _describe(text: str) -> str:
    return text if len(text) <= DESCRIPTION_MAX_CHARS else text[: DESCRIPTION_MAX_CHARS - 1] + "…"


def publish_table(
    records: list[dict[str, Any]], key: str, redact: Redact, settings: PandaStackSettings
) -> Any:
    rows = records[: settings.table_max_rows]
    table = [{str(k): _cell(v, redact) for k, v in row.items()} for row in rows]
    note = f" (first {len(rows)} of {len(records)} rows)" if len(rows) < len(records) else ""
    return create_table_artifact(
        table, key=artifact_key(key, "result"), description=_describe(f"Job result{note}.")
    )


def store_file(data: bytes, relative: str, settings: PandaStackSettings) -> str:
    """Store a collected file; return a link to it."""
    if settings.files_dir:
        target = Path(settings.files_dir, relative)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        return target.resolve().as_uri()
    from prefect.results import get_default_result_storage

    storage: Any = get_default_result_storage(_sync=True)  # type: ignore[call-arg]
    location = storage.write_path(relative, data, _sync=True)
    location = str(location)
    return location if "://" in location else Path(location).resolve().as_uri()


def publish_outcome(
    outcome: JobOutcome,
    key: str,
    redact: Redact,
    *,
    storage_prefix: str = "pandastack",
    settings: Optional[PandaStackSettings] = None,
) -> dict[str, Any]:
    """Publish the artifacts of a successful job; return ``{path or 'result': artifact id}``."""
    settings = settings or get_settings()
    published: dict[str, Any] = {}
    if outcome.has_result and is_records(outcome.result):
        published["result"] = publish_table(outcome.result, key, redact, settings)
    for path, data in outcome.files.items():
        name = PurePosixPath(path).name
        suffix = PurePosixPath(path).suffix.lower()
        if suffix in MARKDOWN_SUFFIXES + HTML_SUFFIXES:
            text = redact(data.decode("utf-8", errors="replace"))
            published[path] = create_markdown_artifact(
                _clip(text, settings.markdown_max_chars, "report"),
                key=artifact_key(key, name),
                description=_describe(f"Report {path} collected from sandbox {outcome.sandbox_id}."),
            )
        else:
            link = store_file(data, f"{storage_prefix}/{name}", settings)
            published[path] = create_link_artifact(
                link,
                link_text=name,
                key=artifact_key(key, name),
                description=_describe(
                    f"{path} ({len(data)} bytes) collected from sandbox {outcome.sandbox_id}."
                ),
            )
    return published


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def dead_letter_owner(outcome: JobOutcome) -> str:
    """What a dead-letter's key names: its task run (else its sandbox), one artifact per failure.

    Keyed by task name alone, every dead-lettered task of that name (mapped
    tasks, identical calls) would add a version to one artifact.
    """
    ctx = TaskRunContext.get()
    return str(ctx.task_run.id) if ctx is not None else (outcome.sandbox_id or "")


def publish_dead_letter(
    outcome: JobOutcome, key: str, redact: Redact, *, command: str = "", template: str = ""
) -> Any:
    """Record a dead-lettered job: what ran, why it will not be retried, and its last output."""
    summary = outcome.summary()
    rows = [
        ("kind", summary["kind"]),
        ("reason", outcome.reason),
        ("exit code", summary["exit_code"]),
        ("command", command),
        ("template", template),
        ("job id", summary["job_id"]),
        ("attempt", summary["try_number"]),
        ("sandbox", summary["sandbox_id"]),
    ]
    lines = [
        "# Dead-lettered sandbox job",
        "",
        "Retrying cannot help this job, so it was not retried. Fix the input or the code, then re-run.",
        "",
        "| field | value |",
        "|---|---|",
        *(
            f"| {name} | {_md_escape(redact(str(value)))} |"
            for name, value in rows
            if value not in (None, "")
        ),
    ]
    for title, tail in (("stderr (tail)", outcome.stderr_tail), ("stdout (tail)", outcome.stdout_tail)):
        if tail.strip():
            body = redact(tail)[-4000:].replace("```", "'''")
            lines += ["", f"## {title}", "", "```", body, "```"]
    return create_markdown_artifact(
        "\n".join(lines),
        key=artifact_key(key, "dead-letter", owner=dead_letter_owner(outcome)),
        description=_describe(f"Dead-lettered: {redact(outcome.reason)}"),
    )
