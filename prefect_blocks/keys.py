"""Naming a job attempt from the Prefect run context, so retries reap what earlier attempts left.

A job is one call: flow name, flow run id, task name, a fingerprint of what it
runs and, inside a task, the task run id. The task run id is what makes two
identical calls in one flow run two jobs (else the retry of one reaps the
other's live sandbox) and it is kept by every retry of that call. Prefect 3.9
gives no per-call name that survives a re-run of the flow run: the task run id
is a fresh uuid7 and the dynamic key a fresh uuid4 on each attempt (the default
task run name is derived from it). So a re-run is recognised by the flow run
instead: the attempt folds the flow run's attempt and the task run's attempt
together, ``try_number = flow_run_count * 1000 + task_run_count``, and the
first job of a flow-run attempt in each process deletes every sandbox that an
earlier attempt of the same flow run left (:func:`reap_dead_flow_attempts`).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import pandastack
from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext, TaskRunContext

from pandastack_jobs import Engine, JobKey, sweep

ENGINE = Engine.PREFECT
FLOW_ATTEMPT_FACTOR = 1000
_KEY_CHARS = re.compile(r"[^a-z0-9-]+")


def fingerprint(
    command: str, files: Optional[Mapping[str, Any]] = None, input: Any = None, template: str = ""
) -> str:
    """A short stable hash of what a job runs (its command, files, input and template)."""
    digest = hashlib.sha256()
    digest.update(command.encode())
    digest.update(b"\x1f" + template.encode())
    for path in sorted(files or {}):
        content = (files or {})[path]
        if isinstance(content, Path):
            data = content.read_bytes()
        elif isinstance(content, str):
            data = content.encode()
        else:
            data = bytes(content)
        digest.update(b"\x1e" + path.encode() + b"\x1f" + hashlib.sha256(data).digest())
    digest.update(b"\x1d" + json.dumps(input, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:12]


def current_job_key(job_name: str, fingerprint_: str) -> Optional[JobKey]:
    """The key of the current attempt, or None outside a flow run (no reaping then)."""
    flow_ctx = FlowRunContext.get()
    task_ctx = TaskRunContext.get()
    flow_run = flow_ctx.flow_run if flow_ctx else None
    if flow_run is None:
        return None
    flow_name = flow_ctx.flow.name if flow_ctx and flow_ctx.flow else str(flow_run.flow_id)
    task_attempt = 1
    task = f"{job_name}:{fingerprint_}"
    if task_ctx is not None:
        task_attempt = max(1, task_ctx.task_run.run_count)
        task = f"{task}:{task_ctx.task_run.id}"
    flow_attempt = flow_run_attempt(flow_run)
    return JobKey(
        engine=ENGINE,
        workflow=flow_name,
        task=task,
        run=str(flow_run.id),
        try_number=flow_attempt * FLOW_ATTEMPT_FACTOR + task_attempt,
    )


_ATTEMPTS: dict[str, int] = {}
_ATTEMPTS_LOCK = threading.Lock()


def flow_run_attempt(flow_run: Any) -> int:
    """The flow run's current attempt, read from the API once per flow run and process.

    The engine's copy of the flow run keeps the ``run_count`` it was loaded with,
    so a retried flow run (a killed worker, then "Retry") would look like its
    first attempt and could not reap what the dead attempt left. One read per
    flow run and process is enough: a flow run whose process died is retried in
    a new process (which reads again), and one retried in the same process has
    already deleted its own sandboxes. The tasks of a long flow then do not pay
    an API round trip each (benchmarks, section 1d).
    """
    local = max(1, int(getattr(flow_run, "run_count", 1) or 1))
    key = str(flow_run.id)
    with _ATTEMPTS_LOCK:
        cached = _ATTEMPTS.get(key)
    if cached is not None:
        return max(cached, local)
    try:
        with get_client(sync_client=True) as client:
            attempt = max(1, client.read_flow_run(flow_run.id).run_count)
    except Exception:  # noqa: BLE001 - offline or unreachable API: the context's count is the best we have
        return local
    with _ATTEMPTS_LOCK:
        _ATTEMPTS[key] = attempt
    return max(attempt, local)


_SWEPT: set[tuple[str, int]] = set()


def reap_dead_flow_attempts(client: pandastack.Client, key: Optional[JobKey]) -> list[str]:
    """Delete the sandboxes earlier attempts of this key's flow run left; once per attempt and process.

    A flow run is only re-run once its earlier attempt ended (a killed worker
    is marked crashed first), so whatever that attempt left is an orphan, even
    though the re-run's task runs have new ids. Best effort, like the core's
    reap: the TTL backstop catches what a failed listing misses.
    """
    if key is None or key.try_number < 2 * FLOW_ATTEMPT_FACTOR:
        return []
    flow_attempt = key.try_number // FLOW_ATTEMPT_FACTOR
    with _ATTEMPTS_LOCK:
        if (key.run_id, flow_attempt) in _SWEPT:
            return []
        _SWEPT.add((key.run_id, flow_attempt))

    def earlier(meta: Mapping[str, str]) -> bool:
        if meta.get("job_run_id") != key.run_id:
            return False
        try:
            return int(meta.get("job_try", "")) // FLOW_ATTEMPT_FACTOR < flow_attempt
        except ValueError:
            return True  # ours, but unreadable: nobody else will delete it

    try:
        return sweep(client, earlier)
    except pandastack.PandastackError:
        with _ATTEMPTS_LOCK:
            _SWEPT.discard((key.run_id, flow_attempt))
        return []


def flow_run_key(flow_name: str, flow_run_id: str) -> JobKey:
    """A key whose ``run_id`` names every job of one flow run (for sweeps)."""
    return JobKey(engine=ENGINE, workflow=flow_name, task="-", run=flow_run_id)


def artifact_key(*parts: str, owner: str = "") -> str:
    """A Prefect artifact key from ``parts``: lowercase letters, digits and dashes only.

    ``owner`` (a task run id, say) is appended after the key is clipped, so it is never cut.
    """

    def slug(text: str) -> str:
        return re.sub(r"-{2,}", "-", _KEY_CHARS.sub("-", text.lower())).strip("-")

    key = slug("-".join(p for p in parts if p))[:200].strip("-") or "pandastack-job"
    return f"{key}-{slug(owner)}" if slug(owner) else key
