"""A task try in the core's terms, and what it leaves for the next try to reap.

Every PandaStack operator names its try as a :class:`~pandastack_jobs.JobKey`
(dag, task, run, map index, try) so the core reaps sandboxes of earlier tries,
and records the sandbox it created in ``task_state_store`` so the next try can
delete it even when this one died before its ``finally``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pandastack

from pandastack_jobs import Engine, JobKey, delete_sandbox

if TYPE_CHECKING:
    from airflow.sdk import Context

ENGINE = Engine.AIRFLOW
STATE_KEY = "pandastack_sandbox_id"
"""``task_state_store`` key holding the sandbox of the running try (read and reaped by the next try)."""


def job_key(context: Context) -> JobKey:
    """The attempt this task try is, in the core's terms."""
    ti = context["ti"]
    map_index = getattr(ti, "map_index", -1)
    return JobKey(
        engine=ENGINE,
        workflow=ti.dag_id,
        task=ti.task_id,
        run=ti.run_id,
        map_index=-1 if map_index is None else int(map_index),
        try_number=int(ti.try_number),
    )


def record_sandbox(log: Any, context: Context, sandbox_id: str) -> None:
    """Remember this try's sandbox in ``task_state_store`` (the next try reaps it if we die)."""
    store = context.get("task_state_store")
    if store is None:
        return
    try:
        store.set(STATE_KEY, sandbox_id)
    except Exception as exc:  # noqa: BLE001 - metadata reaping still covers this try
        log.warning("could not record sandbox in task_state_store: %s", exc)


def forget_sandbox(log: Any, context: Context) -> None:
    """Clear the record once the sandbox is deleted."""
    store = context.get("task_state_store")
    if store is None:
        return
    try:
        store.delete(STATE_KEY)
    except Exception as exc:  # noqa: BLE001
        log.warning("could not clear task_state_store: %s", exc)


def reap_recorded(log: Any, context: Context, client: pandastack.Client) -> str | None:
    """Delete the sandbox an earlier try recorded in ``task_state_store`` (it died before its
    ``finally``); return its id. The core also reaps every sandbox labelled with an earlier try."""
    store = context.get("task_state_store")
    if store is None:
        return None
    try:
        previous = store.get(STATE_KEY)
    except Exception as exc:  # noqa: BLE001 - reaping is best effort; the metadata sweep remains
        log.warning("could not read task_state_store: %s", exc)
        return None
    if not previous:
        return None
    if delete_sandbox(client, str(previous)):
        log.warning("deleted sandbox %s left behind by an earlier try", previous)
    forget_sandbox(log, context)
    return str(previous)
