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
# Which sandboxes a sweep deletes, by their metadata.
Match = Callable[[Mapping[str, str]], bool]


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


def sweep(client: pandastack.Client, match: Match) -> list[str]:
    """Delete every sandbox whose metadata satisfies ``match``; return the ids deleted."""
    deleted = []
    for sb in client.sandboxes.list():
        if match(sb.metadata or {}) and delete_sandbox(client, sb.id):
            deleted.append(sb.id)
    return deleted


def reap_best_effort(client: pandastack.Client, match: Match, what: str) -> list[str]:
    """:func:`sweep` before a new attempt runs, never stopping it; ``what`` names the sandboxes in the log.

    Best effort: if the server cannot be asked, the new attempt goes ahead and
    the TTL backstop catches any orphan.
    """
    try:
        reaped = sweep(client, match)
    except pandastack.PandastackError as exc:
        logger.warning("could not look for %s: %s", what, exc)
        return []
    if reaped:
        logger.info("reaped %d %s: %s", len(reaped), what, reaped)
    return reaped


def is_earlier_try(label: str | None, try_number: int) -> bool:
    """Whether a sandbox's try label names a try before ``try_number``.

    A missing or unreadable label counts as earlier: the sandbox is ours (the
    caller matched it), and nobody else will delete it.
    """
    try:
        return int(label or "") < try_number
    except ValueError:
        return True


def earlier_attempts(key: JobKey) -> Match:
    """The match for the sandboxes of earlier tries of the job ``key`` names."""

    def earlier(meta: Mapping[str, str]) -> bool:
        return meta.get("job_id") == key.job_id and is_earlier_try(meta.get("job_try"), key.try_number)

    return earlier


def redelivered_attempts(key: JobKey) -> Match:
    """The match for the sandboxes of this try and the earlier ones of the job ``key`` names.

    For a redelivery that repeats the try number: a Celery message requeued after its worker died
    carries the same task id and retry count as the delivery that died, so that delivery's sandbox
    is labelled with this very try. Use it only on a delivery the broker marks as redelivered
    (a live first delivery of the same try would be deleted under its job).
    """

    def same_or_earlier(meta: Mapping[str, str]) -> bool:
        return meta.get("job_id") == key.job_id and is_earlier_try(meta.get("job_try"), key.try_number + 1)

    return same_or_earlier


def reap_earlier_attempts(client: pandastack.Client, key: JobKey) -> list[str]:
    """Delete the sandboxes of earlier tries of the job ``key`` names."""
    return sweep(client, earlier_attempts(key))


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
