"""Finding and deleting sandboxes that nobody will delete: orphans of killed attempts.

A worker killed mid-job never reaches its ``finally``. Its sandbox is tagged
with the job's id and try number, so the next attempt deletes it before
creating its own; a sweep deletes every sandbox of a workflow run (for
cancellation hooks and teardown tasks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import pandastack

from .spec import MANAGED_BY, JobKey

logger = logging.getLogger(__name__)


def delete_sandbox(client: pandastack.Client, sandbox_id: str, *, raise_errors: bool = False) -> bool:
    """Delete a sandbox; True if this call deleted it, False if it was already gone.

    Idempotent: 404 means deleted. Other errors are logged, or raised with
    ``raise_errors``.
    """
    try:
        client.sandboxes.delete(sandbox_id)
    except pandastack.NotFoundError:
        return False
    except pandastack.PandastackError as exc:
        if raise_errors:
            raise
        logger.warning("could not delete sandbox %s: %s", sandbox_id, exc)
        return False
    return True


def sweep(client: pandastack.Client, match: Callable[[Mapping[str, str]], bool]) -> list[str]:
    """Delete every sandbox whose metadata satisfies ``match``; return the ids deleted."""
    deleted = []
    for sb in client.sandboxes.list():
        if match(sb.metadata or {}) and delete_sandbox(client, sb.id):
            deleted.append(sb.id)
    return deleted


def reap_earlier_attempts(client: pandastack.Client, key: JobKey) -> list[str]:
    """Delete the sandboxes of earlier tries of the job ``key`` names."""

    def earlier(meta: Mapping[str, str]) -> bool:
        if meta.get("job_id") != key.job_id:
            return False
        try:
            return int(meta.get("job_try", "")) < key.try_number
        except ValueError:
            return True  # ours, but unreadable: nobody else will delete it

    return sweep(client, earlier)


def sweep_run(client: pandastack.Client, key: JobKey) -> list[str]:
    """Delete every sandbox of the workflow run ``key`` belongs to (all tasks, all tries)."""
    return sweep(client, lambda meta: meta.get("job_run_id") == key.run_id)


def sweep_job(client: pandastack.Client, key: JobKey) -> list[str]:
    """Delete every sandbox of the job ``key`` names (all tries, this one included)."""
    return sweep(client, lambda meta: meta.get("job_id") == key.job_id)


def sweep_forks(client: pandastack.Client, parent_id: str) -> list[str]:
    """Delete every fork child of ``parent_id`` (children carry ``forked_from``)."""
    return sweep(client, lambda meta: meta.get("forked_from") == parent_id)


def sweep_managed(client: pandastack.Client) -> list[str]:
    """Delete every sandbox this project created (a last-resort clean-up)."""
    return sweep(client, lambda meta: meta.get("managed_by") == MANAGED_BY)
