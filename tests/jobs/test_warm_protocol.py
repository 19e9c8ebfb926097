"""The warm runner's and attach's wire, on this host's processes: what the runner refuses, and when.

The guest scripts are plain stdlib programs, so their bounds are tested here directly (copied into
a temporary directory, as the pool writes them into ``/work/.warm``): a request with other than
exactly three fds, one past the size cap or not JSON runs nothing; the socket is 0600 and serves
one connection; the runner leaves after its idle limit; what it cannot run warm runs cold.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import socket
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pandastack_jobs import guest
from pandastack_jobs.warm_start import guest_script

HEADER = struct.Struct("!4sI")
SCRIPTS = ("warm_runner.py", "warm_attach.py")


@pytest.fixture
def warm_dir(tmp_path: Path) -> Path:
    for name in SCRIPTS:
        (tmp_path / name).write_bytes(guest_script(name))
    (tmp_path / "mark.py").write_text("open('ran', 'w')\n")
    (tmp_path / "hello.py").write_text("import os, sys\nprint('hello', os.environ.get('PANDASTACK_WARM'))\n")
    return tmp_path


def _start_runner(warm_dir: Path, *args: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, str(warm_dir / "warm_runner.py"), *args],
        cwd=warm_dir,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while not (warm_dir / "state").exists():
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert json.loads((warm_dir / "state").read_text())["ready"] is True
    return proc


def _reply(conn: socket.socket) -> dict[str, object]:
    conn.settimeout(10)
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return json.loads(data) if data else {}


def _attach(warm_dir: Path, argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-I", "-S", str(warm_dir / "warm_attach.py"), *argv],
        cwd=warm_dir,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _connect(warm_dir: Path) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(warm_dir / "runner.sock"))
    return conn


def _request(argv: list[str], cwd: Path) -> bytes:
    return json.dumps({"argv": argv, "env": dict(os.environ), "cwd": str(cwd)}).encode()


@pytest.mark.parametrize("nfds", [2, 4, 6])
def test_a_request_with_other_than_three_fds_runs_nothing(warm_dir: Path, nfds: int) -> None:
    runner = _start_runner(warm_dir)
    marker = warm_dir / "ran"
    payload = _request([sys.executable, "-m", "mark"], warm_dir)
    fds = [os.open(os.devnull, os.O_RDWR) for _ in range(nfds)]
    try:
        with _connect(warm_dir) as conn:
            socket.send_fds(conn, [HEADER.pack(b"PSW1", len(payload))], fds)
            conn.sendall(payload)
            reply = _reply(conn)
    finally:
        for fd in fds:
            os.close(fd)
    # More than the runner makes room for (4) are cut by the kernel, which closes them.
    assert "error" in reply and f"got {min(nfds, 4)}" in str(reply["error"])
    assert runner.wait(10) == 2 and not marker.exists()


@pytest.mark.parametrize(
    "wire",
    [
        (b"PSW1", 2 * 1024 * 1024, b""),  # past the size cap
        (b"NOPE", None, b"{}"),  # not the protocol
        (b"PSW1", None, b"\x80\x04K\x01."),  # a pickle: never loaded
        (b"PSW1", None, b'{"argv": "not a list", "env": {}, "cwd": "/"}'),
        (b"PSW1", None, b'{"argv": ["python3"], "env": {"A": 1}, "cwd": "/"}'),
    ],
)
def test_a_malformed_request_is_refused(warm_dir: Path, wire: tuple[bytes, int | None, bytes]) -> None:
    runner = _start_runner(warm_dir)
    magic, length, body = wire
    header = HEADER.pack(magic, len(body) if length is None else length)
    with _connect(warm_dir) as conn:
        socket.send_fds(conn, [header], [0, 1, 2])
        # The runner may refuse on the header alone (the size cap) and close before the body.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.sendall(body)
        reply = _reply(conn)
    assert "error" in reply
    assert runner.wait(10) == 2


def test_the_socket_is_private_and_serves_one_connection(warm_dir: Path) -> None:
    runner = _start_runner(warm_dir)
    assert stat.S_IMODE((warm_dir / "runner.sock").stat().st_mode) == 0o600
    first = _attach(warm_dir, [sys.executable, "-m", "hello"])
    assert (first.returncode, first.stdout) == (0, "hello 1\n")
    assert runner.wait(10) == 0 and not (warm_dir / "runner.sock").exists()
    second = _attach(warm_dir, [sys.executable, "-m", "hello"])  # nobody listens: cold
    assert (second.returncode, second.stdout) == (0, "hello None\n")


def test_the_runner_leaves_after_its_idle_limit(warm_dir: Path) -> None:
    runner = _start_runner(warm_dir, "--idle", "0.5")
    assert runner.wait(10) == 0
    assert not (warm_dir / "runner.sock").exists()


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["sh", "-c", "echo hello cold"], {}),  # not this interpreter
        ([sys.executable, "-c", "print('hello cold')"], {}),  # not -m MODULE or a file
        ([sys.executable, "-c", "print('hello cold')"], {"PYTHONHASHSEED": "7"}),  # startup differs
    ],
)
def test_what_the_runner_cannot_run_warm_runs_cold(
    warm_dir: Path, argv: list[str], env: dict[str, str]
) -> None:
    runner = _start_runner(warm_dir)
    done = _attach(warm_dir, argv, **env)
    assert (done.returncode, done.stdout) == (0, "hello cold\n")
    assert runner.wait(10) == 0


def test_a_module_with_another_pythonpath_runs_cold(warm_dir: Path) -> None:
    runner = _start_runner(warm_dir)
    done = _attach(warm_dir, [sys.executable, "-m", "hello"], PYTHONPATH=str(warm_dir))
    assert (done.returncode, done.stdout) == (0, "hello None\n")
    assert runner.wait(10) == 0


def test_optional_modules_are_preloaded_and_a_missing_one_is_only_skipped(warm_dir: Path) -> None:
    (warm_dir / "has.py").write_text(
        "import sys\nprint(sorted(m for m in ('decimal', 'fractions') if m in sys.modules))\n"
    )
    runner = _start_runner(warm_dir, "json", "--optional", "no_such_module_xyz", "--optional", "decimal")
    state = json.loads((warm_dir / "state").read_text())
    assert state["optional"] == ["no_such_module_xyz", "decimal"]
    assert [s.split(":")[0] for s in state["skipped"]] == ["no_such_module_xyz"]
    done = _attach(warm_dir, [sys.executable, "-m", "has"])
    assert (done.returncode, done.stdout) == (0, "['decimal']\n")  # the fork has it already
    assert runner.wait(10) == 0


def test_a_preload_that_fails_is_reported_not_served(warm_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(warm_dir / "warm_runner.py"), "no_such_module_xyz"],
        cwd=warm_dir,
        capture_output=True,
        timeout=60,
        check=False,
    )
    state = json.loads((warm_dir / "state").read_text())
    assert proc.returncode == 3 and state["ready"] is False and "no_such_module_xyz" in state["error"]
    assert not (warm_dir / "runner.sock").exists()


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_guest_scripts_are_stdlib_only_python_39(name: str) -> None:
    tree = ast.parse(guest_script(name), feature_version=(3, 9))
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
    }
    assert imported and imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)


def test_attach_kills_after_the_guest_clocks_grace() -> None:
    source = guest_script("warm_attach.py").decode()
    assert f"KILL_GRACE_SECONDS = {guest.KILL_GRACE_SECONDS}\n" in source
