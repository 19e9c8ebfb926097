"""``[core] hostname_callable`` for the e2e workers: the worker's name, so a task instance
records which of the two Celery workers ran it (both run on this one machine)."""

from __future__ import annotations

import os
import socket


def get() -> str:
    return os.environ.get("E2E_WORKER_NAME") or socket.getfqdn()
