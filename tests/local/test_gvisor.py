"""The gVisor backend's own promises (issue 15): a usable runsc or a clear refusal, the boundary
shown on the wire, kills inside the sandbox, nothing left after delete, a memory-copying fork
and the warm pool. Run by ``make test-gvisor`` (it provisions runsc first); the shared suites run
under gVisor there too (PANDASTACK_LOCAL_ISOLATION=gvisor)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandastack
import pytest

from pandastack_local import LocalServer
from tests.local.test_isolation import cgroup_dirs
from tests.support.server import fail_on_leftovers


@pytest.fixture(scope="module")
def gvisor_server() -> Iterator[LocalServer]:
    with LocalServer(isolation="gvisor", pool_size=1) as server:
        yield server


@pytest.fixture
def gclient(gvisor_server: LocalServer) -> Iterator[Any]:
    yield gvisor_server.client()
    fail_on_leftovers(gvisor_server)


def _get(server: LocalServer, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(server.url + path, timeout=10) as resp:
        return dict(json.loads(resp.read()))


def host_traces(server: LocalServer, sandbox_id: str) -> list[str]:
    """Everything of one sandbox the host could still hold: processes naming it (runsc, its
    sandbox and gofer), cgroups, its state dir (bundle, runsc state, socket, images), mounts."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path("/proc", entry, "cmdline").read_bytes()
            except OSError:
                continue
            if sandbox_id.encode() in cmdline:
                found.append(f"process {entry}: {cmdline[:120]!r}")
    # (the bounded walk of test_isolation: other servers' cgroups come and go meanwhile)
    found += [f"cgroup {p}" for p in cgroup_dirs(sandbox_id)]
    if (server.state_dir / "sandboxes" / sandbox_id).exists():
        found.append(f"state dir {server.state_dir / 'sandboxes' / sandbox_id}")
    if server.pid is not None and sandbox_id in Path(f"/proc/{server.pid}/mountinfo").read_text():
        found.append("a mount in the server's namespace")
    return found


def test_the_boundary_shows_on_the_wire(gvisor_server: LocalServer, gclient: Any) -> None:
    assert _get(gvisor_server, "/healthz")["isolation"] == "gvisor"
    version = _get(gvisor_server, "/version")
    assert version["isolation"] == "gvisor" and "runsc" in version["isolation_detail"]
    sb = gclient.sandboxes.create()
    try:
        raw = gclient._request("GET", f"/sandboxes/{sb.id}")
        assert raw["isolation"] == "gvisor"
        # The job sees gVisor's kernel, not the host's.
        assert "Linux version 4.4.0" in sb.exec("cat /proc/version").stdout
        assert os.uname().release not in sb.exec("uname -r").stdout
    finally:
        sb.kill()


def test_bwrap_stays_the_default(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PANDASTACK_LOCAL_ISOLATION"}
    argv = [sys.executable, "-m", "pandastack_local", "serve", "--help"]
    help_text = subprocess.run(argv, capture_output=True, text=True, env=env, check=True).stdout
    assert "--isolation {bwrap,gvisor}" in help_text and "--runsc PATH" in help_text
    with LocalServer(isolation="bwrap", pool_size=0) as server:
        assert _get(server, "/healthz")["isolation"] == "bwrap"


def test_a_missing_runsc_is_refused_with_the_fix(tmp_path: Path) -> None:
    server = LocalServer(isolation="gvisor", runsc=str(tmp_path / "no-runsc"), state_dir=tmp_path / "s")
    with pytest.raises(RuntimeError, match="exited with 2") as err:
        server.start()
    server.close()
    assert "make runsc" in str(err.value) and "bookworm-backports" in str(err.value)
    assert "listening" not in str(err.value)  # never a silent fallback to bwrap


def test_an_old_runsc_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / "runsc"
    fake.write_text("#!/bin/sh\necho 'runsc version release-20220425.0'\n")
    fake.chmod(0o755)
    server = LocalServer(isolation="gvisor", runsc=str(fake), state_dir=tmp_path / "s")
    with pytest.raises(RuntimeError, match=r"older than 0\.0~20240729"):
        server.start()
    server.close()


def test_a_non_root_server_is_told_what_gvisor_needs(tmp_path: Path) -> None:
    """runsc needs root here (rootless runsc applies no cgroup limits): a clear refusal."""
    argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable]
    argv += ["-c", "from pandastack_local.isolation.gvisor.backend import check_runsc; check_runsc(None)"]
    out = subprocess.run(argv, capture_output=True, text=True, cwd="/", check=False)
    assert out.returncode != 0
    assert "needs a root server" in out.stderr and "--isolation bwrap" in out.stderr


def test_egress_is_refused_under_gvisor(tmp_path: Path) -> None:
    server = LocalServer(isolation="gvisor", allow_egress=["127.0.0.1:9"], state_dir=tmp_path / "s")
    with pytest.raises(RuntimeError, match="--allow-egress is not supported with --isolation gvisor"):
        server.start()
    server.close()


def test_a_timeout_kills_inside_the_sandbox(gclient: Any) -> None:
    sb = gclient.sandboxes.create()
    try:
        started = time.monotonic()
        with pytest.raises(pandastack.PandastackError, match="timed out"):
            sb.exec("sleep 300 & sleep 300", timeout_seconds=2)
        assert time.monotonic() - started < 15
        left = sb.exec("ps -eo args | grep -c '^sleep 300' || true").stdout.strip()
        assert left == "0", "the timed-out exec's processes are still alive inside the sandbox"
    finally:
        sb.kill()


def test_output_streams_live_and_apart(gclient: Any) -> None:
    sb = gclient.sandboxes.create()
    try:
        started = time.monotonic()
        seen: list[tuple[float, str, str]] = []
        code = sb.exec_stream(
            "echo out1; echo err1 >&2; sleep 2; echo out2; echo err2 >&2",
            on_stdout=lambda chunk: seen.append((time.monotonic() - started, "stdout", chunk)),
            on_stderr=lambda chunk: seen.append((time.monotonic() - started, "stderr", chunk)),
        )
        assert code == 0
        first_out = next(t for t, _, d in seen if "out1" in d)
        last_out = next(t for t, _, d in seen if "out2" in d)
        assert last_out - first_out > 1.5, f"stdout arrived only after the command finished: {seen}"
        assert "".join(d for _, k, d in seen if k == "stdout") == "out1\nout2\n"
        assert "".join(d for _, k, d in seen if k == "stderr") == "err1\nerr2\n"
    finally:
        sb.kill()


def test_delete_leaves_nothing_behind(gvisor_server: LocalServer, gclient: Any) -> None:
    sb = gclient.sandboxes.create()
    sb.exec("nohup sleep 600 >/dev/null 2>&1 & echo started")
    children = gclient.sandboxes.fork_tree(sb.id, 1)
    parent_dir = gvisor_server.state_dir / "sandboxes" / sb.id
    assert not [p.name for p in parent_dir.iterdir() if p.name.startswith("fork-")], "checkpoint image left"
    assert host_traces(gvisor_server, sb.id), "the probe must see a live sandbox"
    started = time.monotonic()
    for victim in [sb, *children]:
        gclient.sandboxes.delete(victim.id)
    assert time.monotonic() - started < 5
    for victim in [sb, *children]:
        with pytest.raises(pandastack.NotFoundError):
            gclient.sandboxes.get(victim.id)
    gvisor_server.wait_for_teardown()  # the removal finishes after DELETE has answered
    for victim in [sb, *children]:
        assert host_traces(gvisor_server, victim.id) == []


def test_fork_copies_memory(gclient: Any) -> None:
    """A long-lived process started by the agent keeps its in-memory state in every child:
    the children run a copy of it, not a fresh start, and each goes its own way afterwards."""
    sb = gclient.sandboxes.create()
    try:
        server_code = (
            "import os, socket\n"
            "state = {'token': os.urandom(8).hex(), 'hits': 0}\n"
            "s = socket.socket(socket.AF_UNIX); s.bind('/tmp/model.sock'); s.listen(4)\n"
            "while True:\n"
            "    c, _ = s.accept(); state['hits'] += 1\n"
            "    c.sendall(f\"{state['token']} {state['hits']} {os.getpid()}\".encode()); c.close()\n"
        )
        sb.filesystem.write("/root/model.py", server_code)
        sb.exec("nohup python3 /root/model.py >/dev/null 2>&1 &")
        ask = (
            'python3 -c "import socket,time\nfor _ in range(100):\n  try:\n'
            "    s=socket.socket(socket.AF_UNIX); s.connect('/tmp/model.sock'); break\n"
            '  except OSError: time.sleep(0.05)\nprint(s.recv(100).decode())"'
        )
        token, hits, pid = sb.exec(ask).stdout.split()
        assert hits == "1"
        children = gclient.sandboxes.fork_tree(sb.id, 2)
        try:
            assert all(c.boot_mode == "fork" for c in children)
            for child in children:
                c_token, c_hits, c_pid = child.exec(ask).stdout.split()
                # Same token and counter: the process's memory was copied, not re-run.
                assert (c_token, c_hits, c_pid) == (token, "2", pid)
            p_token, p_hits, _ = sb.exec(ask).stdout.split()
            assert (p_token, p_hits) == (token, "2"), "each sandbox counts on its own after the fork"
        finally:
            for child in children:
                child.kill()
    finally:
        sb.kill()


def test_fork_while_an_exec_runs_is_refused_cleanly(gclient: Any) -> None:
    import threading

    sb = gclient.sandboxes.create()
    try:
        running = threading.Thread(target=lambda: sb.exec("sleep 8", timeout_seconds=30))
        running.start()
        time.sleep(1.0)
        with pytest.raises(pandastack.PandastackError, match="busy"):
            gclient.sandboxes.fork_tree(sb.id, 1)
        running.join()
        assert sb.exec("echo still-serving").stdout.strip() == "still-serving"
    finally:
        sb.kill()


def test_the_pool_hands_over_a_gvisor_sandbox(gvisor_server: LocalServer, gclient: Any) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        sb = gclient.sandboxes.create()
        if sb.boot_mode == "pool":
            break
        sb.kill()
        time.sleep(1)
    try:
        assert sb.boot_mode == "pool" and sb.boot_ms < 100
        assert sb.exec("echo ready").stdout.strip() == "ready"
    finally:
        sb.kill()


def test_the_warm_fork_example_keeps_its_model_in_memory(gclient: Any) -> None:
    """sample_jobs/warm (the WarmPool example of dags/ and flows/): the warm-up leaves a model loaded in
    a long-lived process; under gVisor every forked job reads it from that process's memory."""
    from pandastack_jobs import JobSpec, WarmPool

    jobs = Path(__file__).resolve().parents[2] / "sample_jobs" / "warm"
    files = {"warmup.py": (jobs / "warmup.py").read_text(), "score.py": (jobs / "score.py").read_text()}
    with WarmPool(gclient, warmup=JobSpec(command="python3 warmup.py", files=files, timeout=60)) as pool:
        outcomes = [
            pool.run(JobSpec(command="python3 score.py", input={"id": i}, timeout=30)) for i in (1, 2)
        ]
    assert all(o.ok for o in outcomes), [o.reason for o in outcomes]
    results = [o.result for o in outcomes]
    assert {r["model_source"] for r in results} == {"memory"}
    assert len({r["model_built_at"] for r in results}) == 1
    # The same process of the parent answered in each child: it was copied, not started again.
    assert len({r["model_served_by"] for r in results}) == 1 and results[0]["model_served_by"]


def _wait_for_boot_image(server: LocalServer, timeout: float = 60.0) -> list[Path]:
    images = server.state_dir / "gvisor-images"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        made = [p for p in images.iterdir() if (p / "checkpoint.img").exists()] if images.is_dir() else []
        if made and "boot image of template" in server.log_tail(200):
            return made
        time.sleep(0.2)
    raise AssertionError(f"no boot image after {timeout}s:\n{server.log_tail()}")


def _created_how(sb: Any) -> str:
    return next(line for line in sb.logs() if "created from template" in line)


@pytest.fixture
def short_state_dir() -> Iterator[Path]:
    """A state dir of the server's own, short enough for the agents' socket paths."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="gvi-", dir="/tmp"))
    yield path / "state"
    shutil.rmtree(path, ignore_errors=True)


def test_cold_creates_restore_the_templates_boot_image(short_state_dir: Path) -> None:
    """The first cold create boots; the server checkpoints a fresh sandbox as the template's
    boot image and later cold creates restore it. Restored sandboxes are independent copies of
    a never-used sandbox: what one does is not in the other, and delete leaves no trace."""
    with LocalServer(isolation="gvisor", pool_size=0, state_dir=short_state_dir) as server:
        client = server.client()
        first = client.sandboxes.create()
        assert first.boot_mode == "cold" and "restored" not in _created_how(first)
        first.exec("echo first > /work/mark && sleep 3600 &")
        (image,) = _wait_for_boot_image(server)
        a, b = client.sandboxes.create(), client.sandboxes.create()
        try:
            for sb in (a, b):
                assert sb.boot_mode == "snapshot"  # the real server's word for a restored create
                assert "restored from the template's boot image" in _created_how(sb)
                # A never-used sandbox: nothing of the first one, nothing of the other restored one.
                assert sb.exec("ls -A /work /tmp").stdout.split() == ["/tmp:", "/work:"]
                assert "sleep 3600" not in sb.exec("ps -eo args").stdout
            # Clones of one image, yet each draws its own randomness (getrandom and /dev/urandom).
            draw = "python3 -c 'import os; print(os.urandom(16).hex())'; od -An -N16 -tx1 /dev/urandom"
            assert a.exec(draw).stdout != b.exec(draw).stdout
            a.exec("echo a > /work/mark")
            assert b.exec("cat /work/mark").exit_code != 0
            assert a.exec("cat /work/mark").stdout.strip() == "a"
            # The template's limits hold in a restored sandbox as in a booted one.
            limits = a.exec("ulimit -n; ulimit -u").stdout.split()
            assert limits == first.exec("ulimit -n; ulimit -u").stdout.split()
        finally:
            for sb in (first, a, b):
                sb.kill()
        server.wait_for_teardown()
        for sb in (first, a, b):
            assert host_traces(server, sb.id) == []
    # The server's shutdown removes the image with its state.
    assert not image.exists()


def test_a_boot_image_that_does_not_restore_falls_back_to_a_boot(short_state_dir: Path) -> None:
    """A damaged image costs one failed restore, never a failed create: the server drops it
    and boots (and does not try to restore it again)."""
    with LocalServer(isolation="gvisor", pool_size=0, state_dir=short_state_dir) as server:
        client = server.client()
        client.sandboxes.create().kill()
        (image,) = _wait_for_boot_image(server)
        (image / "checkpoint.img").write_bytes(b"not a checkpoint")
        sb = client.sandboxes.create()
        try:
            assert sb.boot_mode == "cold" and "restored" not in _created_how(sb)
            assert sb.exec("echo up").stdout.strip() == "up"
            assert "boot image did not restore" in server.log_tail(200)
            assert not image.exists()
        finally:
            sb.kill()
        again = client.sandboxes.create()
        try:
            assert "restored" not in _created_how(again)
        finally:
            again.kill()
