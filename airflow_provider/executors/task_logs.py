"""The task-log relay: a try's log comes out of its sandbox before the sandbox is deleted.

``common.sandbox`` expects remote logging instead (a finished sandbox is gone). Here the task
writes its log inside the sandbox (``GUEST_LOG_FOLDER``), the executor reads its last
``MAX_TASK_LOG_BYTES`` with the driver's ``read_file`` (a PandaStack extension of the contract)
and writes it, with the executor's own lines, where the UI reads it (``[logging]
base_log_folder``). A path that would leave that folder is not written.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .contract import SandboxDriver
from .models import SandboxExecutionRef, SandboxOutput, SandboxResult

# Inside the sandbox: the task log folder lives in the throwaway work dir.
GUEST_LOG_FOLDER = "/work/logs"
MAX_TASK_LOG_BYTES = 8 * 1024 * 1024
FAILURE_TAIL_LINES = 20
PREFIX = "PandaStackExecutor"


def failure_lines(
    ref: SandboxExecutionRef, result: SandboxResult, output: SandboxOutput | None, hint: str | None
) -> list[str]:
    """What a failed try's log ends with: the end state (exit code, the hint) and the output's tail."""
    sandbox = ref.handle.display_name or ref.request_id
    head = f"{PREFIX}: sandbox {sandbox}: {result.message or result.state.value}"
    if result.exit_code is not None and "exit code" not in head:
        head += f" (exit code {result.exit_code})"
    if hint:
        head += f"; {hint}"
    lines = [head]
    if output is not None:
        tail = (
            output.stdout + ("\n" if output.stdout and output.stderr else "") + output.stderr
        ).splitlines()
        tail = [line for line in tail if line.strip()][-FAILURE_TAIL_LINES:]
        if tail:
            lines.append(f"{PREFIX}: last {len(tail)} line(s) of the sandbox's output:")
            lines.extend(tail)
    return lines


class TaskLogRelay:
    """Reads a try's log out of its sandbox and writes it (and the executor's lines) on this host."""

    def __init__(self, base_log_folder: str, log: Any) -> None:
        self.base_log_folder = base_log_folder
        self.log = log

    async def read(self, driver: SandboxDriver, ref: SandboxExecutionRef) -> bytes | None:
        """The last bytes of the try's log in its sandbox; None when absent or unreadable."""
        log_path = ref.handle.data.get("log_path")
        read_file = getattr(driver, "read_file", None)
        if not log_path or read_file is None:
            return None
        try:
            data = await read_file(ref.handle, f"{GUEST_LOG_FOLDER}/{log_path}", MAX_TASK_LOG_BYTES)
        except Exception:  # the delete must still happen
            self.log.warning("could not read the task log of %s", ref.request_id, exc_info=True)
            return None
        return None if data is None else bytes(data)[-MAX_TASK_LOG_BYTES:]

    def write(self, log_path: object, log: bytes | None, lines: list[str]) -> None:
        """Put ``log`` (replacing the file) or else append ``lines`` where Airflow reads the try's log."""
        if not isinstance(log_path, str) or not log_path or not self.base_log_folder:
            return
        base = Path(self.base_log_folder).resolve()
        target = (base / log_path).resolve()
        if base not in target.parents:
            self.log.warning("%s: log path %r leaves the log folder; not written", PREFIX, log_path)
            return
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "ab" if log is None else "wb") as fh:
                if log is not None:
                    fh.write(log if log.endswith(b"\n") or not log else log + b"\n")
                for line in lines:
                    record = {
                        "timestamp": datetime.now(timezone.utc).isoformat(),
                        "level": "error",
                        "logger": PREFIX,
                        "event": line,
                    }
                    fh.write(json.dumps(record).encode() + b"\n")
        except OSError:
            self.log.warning("%s: could not write the task log %s", PREFIX, target, exc_info=True)
