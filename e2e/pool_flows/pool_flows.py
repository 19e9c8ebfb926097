"""E2E-only flow for the ``pandastack`` work pool: it records, from inside, where it runs.

Only Prefect is imported: the sandbox carries the Prefect venv and this directory, nothing else.
"""

from __future__ import annotations

import json
import os
import socket
import time

from prefect import flow
from prefect.artifacts import create_markdown_artifact


def _reachable(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return False
    return True


@flow(name="pool-inside")
def pool_inside(seconds: float = 0.0, pandastack_port: int = 0) -> int:
    facts = {
        "hostname": socket.gethostname(),
        "agent": os.path.exists("/.pandastack/agent.py"),
        "pandastack_api_reachable": _reachable(pandastack_port) if pandastack_port else None,
        "env": sorted(os.environ),
    }
    create_markdown_artifact(markdown=json.dumps(facts), key="pool-inside-facts")
    deadline = time.time() + seconds
    while time.time() < deadline:
        time.sleep(0.2)
    return 42
