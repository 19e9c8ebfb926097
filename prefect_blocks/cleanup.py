"""Flow hooks that delete a flow run's sandboxes when the run is cancelled or crashes.

Each job deletes its own sandbox in ``finally``; these hooks catch what a
killed process never got to delete. Every sandbox names its flow run in its
metadata, so the sweep (the core's ``sweep_run``) deletes exactly that run's
sandboxes::

    hook = sandbox_cleanup_hook(credentials)

    @flow(on_cancellation=[hook], on_crashed=[hook])
    def my_flow(): ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from pandastack_jobs import sweep_run

from .credentials import PandaStackCredentials, resolve_credentials
from .execution import run_logger
from .keys import flow_run_key

StateHook = Callable[[Any, Any, Any], None]


def sweep_flow_run(
    flow_name: str, flow_run_id: str, credentials: Optional[PandaStackCredentials] = None
) -> list[str]:
    """Delete every sandbox the flow run ``flow_run_id`` of ``flow_name`` left; return their ids."""
    creds = resolve_credentials(credentials)
    return sweep_run(creds.get_client(), flow_run_key(flow_name, flow_run_id))


def sandbox_cleanup_hook(credentials: Optional[PandaStackCredentials] = None) -> StateHook:
    """A flow state hook (``on_cancellation``, ``on_crashed``) that sweeps the run's sandboxes."""

    def delete_flow_run_sandboxes(flow: Any, flow_run: Any, state: Any) -> None:
        deleted = sweep_flow_run(flow.name, str(flow_run.id), credentials)
        log = run_logger()
        log.info(
            "pandastack: flow run %s is %s; deleted %d sandbox(es) it left: %s",
            flow_run.id,
            getattr(state, "name", state),
            len(deleted),
            deleted,
        )

    return delete_flow_run_sandboxes
