"""``make demo``'s queue part (demo/queue_demo.py): twenty messages on the Redis the demo starts,
each ending as it should, and that Redis gone afterwards whatever happened."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from demo import queue_demo
from e2e.procs import port_open
from pandastack_jobs import ConnectionConfig
from pandastack_local import LocalServer

REPO = Path(__file__).resolve().parents[2]


def _port(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


def test_the_queue_demo_acks_redelivers_and_dead_letters_with_reasons(
    local_server: LocalServer, tmp_path: Path
) -> None:
    said: list[str] = []
    conn = ConnectionConfig(api_url=local_server.url, api_key=local_server.api_key)
    before = set(Path(tempfile.gettempdir()).glob("pandastack-demo-redis-*"))
    started = time.monotonic()
    summary = queue_demo.main(tmp_path, conn, said.append)
    assert time.monotonic() - started < 120
    assert summary.problems == [], _explain(summary.problems, tmp_path / "queue.log", local_server)
    assert len(summary.rows) == 20
    stats = summary.stats
    assert (stats["acked"], stats["redelivered"], stats["dead_lettered"]) == (14, 4, 6), stats
    assert stats["received"] == 24 and summary.left_in_queue == 0, stats
    dead = {r.id: r for r in summary.rows if r.outcome == "dead-lettered"}
    assert set(dead) == {
        "evil-fork-bomb",
        "evil-memory-hog",
        "evil-sleeper",
        "evil-disk-filler",
        "malformed",
        "poison",
    }
    assert dead["evil-fork-bomb"].kind == "timeout" and "4s timeout" in dead["evil-fork-bomb"].reason
    assert dead["evil-memory-hog"].kind == "permanent_exit_code" and "137" in dead["evil-memory-hog"].reason
    assert "out of memory" in dead["evil-memory-hog"].reason
    assert dead["evil-sleeper"].reason.startswith("gave up after 2 deliveries (max_deliveries=2)")
    assert "No space left on device" in dead["evil-disk-filler"].reason
    assert dead["malformed"].kind == "malformed" and dead["malformed"].reason.startswith("comand:")
    assert dead["poison"].deliveries == 2 and "ZeroDivisionError" in dead["poison"].reason
    flaky = next(r for r in summary.rows if r.id == "flaky")
    assert flaky.outcome == "acked" and flaky.result == {"delivery": 2}
    # The printed summary carries the counts and every dead letter's reason.
    text = "\n".join(summary.lines())
    assert "acked 14  redelivered 4  dead-lettered 6" in text
    assert "[malformed] comand: is not a message field" in text
    # The demo's Redis is stopped, its directory gone; no sandbox is left.
    url = next(line.split()[1] for line in said if line.strip().startswith("Redis "))
    assert not port_open(_port(url))
    assert set(Path(tempfile.gettempdir()).glob("pandastack-demo-redis-*")) <= before
    # Only the demo's: the session's server is shared with other tests.
    ours = [sb.id for sb in local_server.client().sandboxes.list() if _workflow(sb) == queue_demo.STREAM]
    assert ours == []


def _workflow(sandbox: Any) -> str | None:
    return (sandbox.metadata or {}).get("job_workflow")


def _explain(problems: list[str], consumer_log: Path, server: LocalServer) -> str:
    """The problems, with the consumer's and the server's last lines (a red CI shows why)."""
    tails = [f"{path}:\n{_tail(path)}" for path in (consumer_log, server.log_path)]
    return "\n".join([*problems, *tails])


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(unreadable: {exc})"


def test_the_demo_redis_is_stopped_on_ctrl_c(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def interrupted(url: str, _conn: Any) -> Any:
        seen.append(url)
        port, password = _port(url), urlsplit(url).password
        assert password and port_open(port)
        # Password-protected, and the password on no command line another user could read.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"PING\r\n")
            assert s.recv(64).startswith(b"-NOAUTH")
        cmdlines = [_read(p) for p in Path("/proc").glob("[0-9]*/cmdline")]
        ours = [
            c for c in cmdlines if c.startswith(b"/") and b"redis-server" in c and str(port).encode() in c
        ]
        assert ours and not any(password.encode() in c for c in cmdlines)
        raise KeyboardInterrupt

    monkeypatch.setattr(queue_demo, "run_queue_demo", interrupted)
    with pytest.raises(KeyboardInterrupt):
        queue_demo.main(tmp_path, ConnectionConfig(api_url="http://127.0.0.1:9", api_key="k"), lambda _: None)
    assert seen and not port_open(_port(seen[0]))


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # the process exited meanwhile
        return b""


_HOLD = """
import sys, time
from pathlib import Path
from demo.redis_server import redis_server
with redis_server(Path(sys.argv[1]) / "redis.log", tmp=Path(sys.argv[1])) as url:
    print(url, flush=True)
    time.sleep(120)
"""


def test_the_demo_redis_dies_with_a_killed_demo(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert proc.stdout is not None
        port = _port(proc.stdout.readline().strip())
        assert port_open(port)
        proc.send_signal(signal.SIGKILL)  # no finally runs: the parent-death signal stops Redis
        proc.wait(10)
        deadline = time.monotonic() + 15
        while port_open(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not port_open(port), "the demo's Redis outlived the SIGKILLed demo"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        _kill_orphan(tmp_path / "redis.log")


def _kill_orphan(log: Path) -> None:
    """When the test failed, the Redis it started is stopped by the pid in its log."""
    found = re.search(r"pid=(\d+)", log.read_text(errors="replace")) if log.exists() else None
    if found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(found.group(1)), signal.SIGKILL)
