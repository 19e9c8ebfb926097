"""Deferrable mode: the trigger that waits for a detached job's exit marker.

The operator starts the job detached (:func:`pandastack_jobs.start_detached`)
and defers; this trigger polls :func:`pandastack_jobs.poll_detached` in a
thread (the SDK is synchronous) until the job's exit marker appears, the
sandbox vanishes, or the job's deadline passes, then hands control back to
``execute_complete``, which collects and deletes. The worker slot is free
meanwhile.

When the user kills the deferred task (mark failed, clear, mark success),
Airflow 3.3 calls :meth:`on_kill`, which deletes the sandbox. A triggerer
restart or redistribution cancels ``run()`` without ``on_kill``: the sandbox is
kept on purpose, because another triggerer picks the job up again (the TTL
backstop and the next try's reaping catch it if nobody does).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from functools import cached_property
from typing import Any

import pandastack
from airflow.triggers.base import BaseTrigger, TriggerEvent

from pandastack_jobs import DetachedJob, SandboxGone, delete_sandbox, poll_detached

from ..hooks.pandastack import PandaStackHook


class PandaStackJobTrigger(BaseTrigger):
    """Fires once: ``{"status": "exited"|"gone"|"deadline", "job": {...}, ...}``.

    :param job: :meth:`DetachedJob.to_dict` of the running job.
    :param pandastack_conn_id: the ``pandastack`` connection.
    :param poll_interval: seconds between polls.
    """

    def __init__(
        self,
        job: dict[str, Any],
        pandastack_conn_id: str = PandaStackHook.default_conn_name,
        poll_interval: float = 2.0,
    ) -> None:
        super().__init__()
        self.job = DetachedJob.from_dict(job).to_dict()
        self.pandastack_conn_id = pandastack_conn_id
        self.poll_interval = float(poll_interval)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "job": self.job,
                "pandastack_conn_id": self.pandastack_conn_id,
                "poll_interval": self.poll_interval,
            },
        )

    @cached_property
    def hook(self) -> PandaStackHook:
        return PandaStackHook(pandastack_conn_id=self.pandastack_conn_id)

    async def _client(self) -> pandastack.Client:
        """The SDK client from the hook: its key is masked in logs and redacted in messages."""
        return await self.hook.aget_conn()

    def _event(self, status: str, **extra: Any) -> TriggerEvent:
        return TriggerEvent({"status": status, "job": self.job, **extra})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        job = DetachedJob.from_dict(self.job)
        client = await self._client()
        failures = 0
        while True:
            try:
                exit_code = await asyncio.to_thread(poll_detached, client, job.sandbox_id)
            except SandboxGone as exc:
                yield self._event("gone", message=str(exc))
                return
            except pandastack.PandastackError as exc:
                # Transient API trouble: keep polling until the deadline; the end is classified
                # by execute_complete either way.
                failures += 1
                self.log.warning(
                    "PandaStack poll of %s failed (%d): %s",
                    job.sandbox_id,
                    failures,
                    self.hook.redactor(str(exc)),
                )
                exit_code = None
            if exit_code is not None:
                yield self._event("exited", exit_code=exit_code)
                return
            if time.time() > job.deadline:
                yield self._event("deadline", message="the job's deadline passed with no exit marker")
                return
            await asyncio.sleep(self.poll_interval)

    async def on_kill(self) -> None:
        """The user killed the deferred task: delete its sandbox."""
        sandbox_id = self.job["sandbox_id"]
        client = await self._client()
        deleted = await asyncio.to_thread(delete_sandbox, client, sandbox_id)
        self.log.info("task killed while deferred; sandbox %s deleted=%s", sandbox_id, deleted)
