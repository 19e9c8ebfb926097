"""Each test proves one wall of the sandbox: it must be able to fail if the wall is missing."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pandastack
import pytest

from pandastack_local.testing.procs import own_sleep, pids_matching
from tests.support.server import GVISOR

CGROUP_ROOT = Path("/sys/fs/cgroup")
FORK_BOMB = """
import os, time
n = 0
while True:
    try:
        pid = os.fork()
    except OSError:
        print("wall at", n, flush=True)
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    n += 1
"""
PORT_PROBE = """
import socket
try:
    socket.create_connection(("127.0.0.1", PORT), timeout=2)
    print("CONNECTED")
except OSError as e:
    print("refused", e)
"""


def cgroup_dirs(name: str) -> list[Path]:
    """Every cgroup directory called ``name``, in any controller.

    Other servers create and remove cgroups while this walks, so a directory
    vanishing mid-walk is skipped, not an error.
    """
    out = []
    for controller in CGROUP_ROOT.iterdir():
        if not controller.is_dir():
            continue
        for parent, dirs, _files in os.walk(controller, onerror=lambda _exc: None):
            out.extend(Path(parent) / d for d in dirs if d == name)
    return out


def test_memory_hog_is_killed_and_neighbours_are_fine(small_client, small_server) -> None:
    hog = small_client.sandboxes.create(template="small")
    sibling = small_client.sandboxes.create(template="small")
    try:
        sibling.filesystem.write("/work/state", b"alive")
        result = hog.exec(
            "python3 -c 'b = []\nwhile True: b.append(bytearray(16 * 1024 * 1024))'", timeout_seconds=60
        )
        if GVISOR:  # gVisor's sentry fails the job's allocation; the host OOM killer is not reached
            assert result.exit_code != 0, result
        elif "memory" in small_server.active_limits():
            assert result.exit_code == 137, result  # the cgroup's OOM killer
        else:  # non-root on cgroup v1: RLIMIT_AS, the allocation fails inside the job
            assert result.exit_code == 1 and "MemoryError" in result.stderr, result
        # The sandbox itself survived its job's OOM and still works.
        assert hog.exec("echo ok").stdout == "ok\n"
        assert sibling.exec("cat /work/state").stdout == "alive"
        assert small_server.running()
    finally:
        hog.kill()
        sibling.kill()


def test_fork_bomb_is_contained(small_client, small_server) -> None:
    bomb = small_client.sandboxes.create(template="small")
    sibling = small_client.sandboxes.create(template="small")
    try:
        bomb.filesystem.write("/work/bomb.py", FORK_BOMB)
        try:
            result = bomb.exec("python3 /work/bomb.py", timeout_seconds=30)
        except pandastack.ServerError as exc:
            # gVisor only: RLIMIT_NPROC is the jobs' wall there, but 64 Pythons can pass this
            # 256 MB template's memory first, and the host's OOM killer then takes the whole
            # sentry: that sandbox fails (500, then "failed"); its neighbours and the server do not.
            assert GVISOR and "not running" in str(exc), exc
            assert small_client.sandboxes.get(bomb.id).status == "failed"
        else:
            assert "wall at" in result.stdout, result
            count = int(result.stdout.split("wall at")[1].split()[0])
            assert count < 64
        assert sibling.exec("echo fine").stdout == "fine\n"
        assert small_server.running()
    finally:
        bomb.kill()
        sibling.kill()


def test_background_process_lives_until_delete(small_client) -> None:
    marker = own_sleep(10)
    sb = small_client.sandboxes.create(template="small")
    try:
        assert sb.exec(f"nohup sh -c '{marker}' >/dev/null 2>&1 &").exit_code == 0
        time.sleep(0.2)
        assert sb.exec("ps -eo args 2>/dev/null || cat /proc/[0-9]*/cmdline").exit_code == 0
        # A later exec still sees it: execs share the sandbox's namespaces.
        assert marker in sb.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout
        # Under gVisor the job's processes live in the sentry: the host sees runsc's, named by id.
        probe = sb.id if GVISOR else marker
        assert pids_matching(probe), "background process should be running on the host"
    finally:
        sb.kill()
    deadline = time.monotonic() + 5
    while pids_matching(probe) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pids_matching(probe), "background process survived its sandbox"


def test_host_files_and_other_sandboxes_are_invisible(small_client, tmp_path) -> None:
    marker = Path("/tmp") / f"pandastack-host-marker-{os.getpid()}"
    marker.write_text("host secret")
    root_marker = Path("/root") / f".pandastack-host-marker-{os.getpid()}"
    root_marker.write_text("host secret")
    a = small_client.sandboxes.create(template="small")
    b = small_client.sandboxes.create(template="small")
    try:
        a.filesystem.write("/tmp/a-secret", b"only a")
        a.filesystem.write("/work/a-secret", b"only a")
        for path in (str(marker), str(root_marker), "/tmp/a-secret", "/work/a-secret"):
            assert b.exec(f"cat {path}").exit_code != 0, path
            assert not b.filesystem.exists(path), path
        assert not a.filesystem.exists(str(marker))
        # The host's /etc is not there: only the synthesized minimal one.
        passwd = b.exec("cat /etc/passwd").stdout
        assert passwd.startswith("root:x:0:0:") and len(passwd.splitlines()) <= 2
        assert b.exec("ls /home /opt/app 2>&1; ls /").stdout.count("a-secret") == 0
        # Template files were copied in, and the copy is private and writable.
        assert b.filesystem.read("/opt/app/hello.txt") == b"from the template\n"
        b.filesystem.write("/opt/app/hello.txt", b"changed in b")
        assert a.filesystem.read("/opt/app/hello.txt") == b"from the template\n"
        # System dirs are read-only.
        assert b.exec("touch /usr/bin/evil").exit_code != 0
        assert not Path("/usr/bin/evil").exists()
    finally:
        marker.unlink()
        root_marker.unlink()
        a.kill()
        b.kill()


def test_host_processes_server_port_and_env_are_invisible(small_client, small_server, canary) -> None:
    canary_env, canary_value = canary
    sb = small_client.sandboxes.create(template="small")
    try:
        pids = sb.exec("ls /proc | grep -E '^[0-9]+$'").stdout.split()
        assert len(pids) < 10, pids
        assert (
            str(small_server.pid) not in pids
            or "pandastack_local" not in sb.exec(f"cat /proc/{small_server.pid}/cmdline").stdout
        )
        assert "pandastack_local" not in sb.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout
        port = small_server.port
        sb.filesystem.write("/work/probe.py", PORT_PROBE.replace("PORT", str(port)))
        out = sb.exec("python3 /work/probe.py").stdout
        assert "CONNECTED" not in out and "refused" in out
        # Only loopback exists: no route anywhere.
        assert sb.exec("cat /proc/net/dev").stdout.count(":") == 1
        env = sb.exec("env; cat /proc/1/environ /proc/self/environ 2>/dev/null | tr '\\0' '\\n'").stdout
        assert canary_value not in env and canary_env not in env
        assert small_server.api_key not in env
        assert "PATH=" in env and "HOME=/root" in env
        # The server's own environment does hold the canary (so the assertion above can fail).
        server_env = Path(f"/proc/{small_server.pid}/environ").read_bytes()
        assert canary_value.encode() in server_env
    finally:
        sb.kill()


def test_delete_leaves_nothing_behind(small_client, small_server) -> None:
    sb = small_client.sandboxes.create(template="small")
    job = own_sleep(43)
    sb.exec(f"dd if=/dev/zero of=/work/blob bs=1M count=8 2>/dev/null; nohup {job} >/dev/null 2>&1 &")
    sandbox_dir = small_server.state_dir / "sandboxes" / sb.id
    assert sandbox_dir.is_dir()
    cgroups = cgroup_dirs(sb.id)
    if small_server.active_limits():  # none for a non-root server on cgroup v1
        assert cgroups, "expected the sandbox to have cgroups"
    sb.kill()
    # Gone for its clients at once (DELETE answers once it is stopped) ...
    with pytest.raises(pandastack.NotFoundError):
        small_client.sandboxes.get(sb.id)
    # ... and from the host once its removal, finished in the background, is done.
    small_server.wait_for_teardown()
    assert not sandbox_dir.exists()
    assert not cgroup_dirs(sb.id)
    assert not pids_matching(sb.id)
    time.sleep(0.1)
    assert not pids_matching(job)
    with pytest.raises(pandastack.NotFoundError):
        small_client.sandboxes.get(sb.id)


def test_disk_and_open_file_limits(small_client) -> None:
    sb = small_client.sandboxes.create(template="small")
    try:
        out = sb.exec("dd if=/dev/zero of=/work/big bs=1M count=200 2>&1; echo rc=$?")
        assert "No space left on device" in out.stdout
        assert "rc=0" not in out.stdout
        assert sb.exec("ulimit -n").stdout.strip() == "128"
        assert sb.exec("rm /work/big && echo freed").stdout == "freed\n"
    finally:
        sb.kill()


def test_paths_cannot_escape(small_client) -> None:
    sb = small_client.sandboxes.create(template="small")
    try:
        with pytest.raises(pandastack.BadRequestError):
            sb.filesystem.read("/work/../../etc/passwd")
        with pytest.raises(pandastack.BadRequestError):
            sb.filesystem.write("/work/../../tmp/x", b"x")
        # A symlink to a host path resolves inside the sandbox, where that host file does not exist.
        host_only = Path("/etc/hostname") if Path("/etc/hostname").exists() else Path("/etc/os-release")
        sb.exec(f"ln -s {host_only} /work/link && ln -s /usr/bin /work/usrlink")
        if host_only.name != "hostname":
            with pytest.raises(pandastack.ServerError):
                sb.filesystem.read("/work/link")
        else:
            assert sb.filesystem.read("/work/link") == b"sandbox\n"
        # The OS refused: a 4xx. Under gVisor the host's /usr is not the sandbox root's (the sentry's
        # uids are mapped), so the permission check answers before the read-only mount does.
        refused = "Permission denied" if GVISOR else "Read-only file system"
        with pytest.raises(pandastack.BadRequestError, match=refused):
            sb.filesystem.write("/work/usrlink/evil", b"x")
        assert not Path("/usr/bin/evil").exists()
    finally:
        sb.kill()


def test_host_kernel_interfaces_are_locked(small_client) -> None:
    sb = small_client.sandboxes.create(template="small")
    try:
        assert sb.exec("grep CapEff /proc/self/status").stdout.split()[1] == "0000000000000000"
        assert sb.exec("echo 1 > /proc/sys/vm/drop_caches").exit_code != 0
        before = Path("/proc/sys/kernel/core_pattern").read_text()
        assert sb.exec("echo '|/tmp/x' > /proc/sys/kernel/core_pattern").exit_code != 0
        assert Path("/proc/sys/kernel/core_pattern").read_text() == before
        # No nested user namespace under bwrap; under gVisor one is the sentry's own, no host kernel's.
        assert (sb.exec("unshare -U -r true").exit_code != 0) is not GVISOR
        assert sb.exec("mount -t tmpfs x /mnt 2>&1").exit_code != 0
        if not GVISOR:  # gVisor's /sys is the sentry's synthetic, read-only one
            assert sb.exec("ls /sys 2>&1").exit_code != 0 or sb.exec("ls /sys").stdout == ""
    finally:
        sb.kill()


def test_host_can_still_run_processes_after_walls(small_server) -> None:
    # Sanity: the host side is unaffected by everything above.
    assert subprocess.run(["true"], check=False).returncode == 0
    with socket.create_connection(("127.0.0.1", small_server.port), timeout=2):
        pass
