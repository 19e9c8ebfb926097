"""One real ``celery worker`` process for the tests that need one (tests/celery_tasks and the e2e
Celery leg): started in its own process group of a :class:`ProcessGroup`, ready when it says so."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from e2e.procs import ProcessGroup
from e2e.services import REPO
from pandastack_local.testing.waiting import wait_for


class Worker:
    """One ``celery worker`` process in its own process group (noted in the run's pgids file, so
    run.sh kills it whatever happens), logging to a file."""

    def __init__(self, group: ProcessGroup, name: str, argv: list[str], env: dict[str, str], events: Path):
        self.group, self.events = group, events
        self.proc = group.start(name, argv, env=env, cwd=REPO)
        self.popen = self.proc.popen
        wait_for(
            "the celery worker to be ready",
            lambda: "ready." in self.text() or self.popen.poll() is not None,
            timeout=60,
            interval=0.2,
        )
        assert self.popen.poll() is None, self.text()

    def kill(self) -> None:
        """SIGKILL the whole worker: the main process and its pool processes."""
        os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)

    def text(self) -> str:
        return self.proc.log_path.read_text(errors="replace")

    def lines(self, what: str, task_id: str) -> list[list[str]]:
        if not self.events.exists():
            return []
        rows = [line.split() for line in self.events.read_text().splitlines()]
        return [r for r in rows if r[:2] == [what, task_id]]
