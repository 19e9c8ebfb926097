"""Issue 23, crossings 1-6: under gVisor a sandbox's socket directory was a host directory bound
read-write into the guest, and the server (host root) worked on it by path. Each test attacks
that directory through the real SDK, as a job would, and also plants on the host what an escaped
guest could write there. Under bwrap the guest has no host directory at all: the same attacks
run and each test states what bwrap's outcome is (nothing is skipped).

Every test restores what it touched on the host: planted targets are files under ``tmp_path``,
and a tree a wall fails to delete is removed by the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pandastack_local import LocalServer
from pandastack_local.isolation.gvisor.backend import GUEST_SOCKET_DIR
from pandastack_local.testing.procs import own_sleep
from tests.security.conftest import SMALL
from tests.support.server import GVISOR, write_template

MiB = 1024 * 1024
DEEP = 3000
# What the host's free space may move by, beside the cap, from other processes on this machine.
FREE_SPACE_SLACK = 100 * MiB

WRITE_FLOOD = r"""
import errno, json, os, sys
where, total = sys.argv[1], int(sys.argv[2])
out = {"written": 0, "error": ""}
chunk = b"\xa5" * (1 << 20)
try:
    os.makedirs(where, exist_ok=True)
    with open(os.path.join(where, "flood"), "wb", buffering=0) as f:
        while out["written"] < total:
            out["written"] += f.write(chunk)
except OSError as exc:
    out["error"] = errno.errorcode.get(exc.errno, str(exc.errno))
print(json.dumps(out))
"""

DEEP_TREE = r"""
import errno, json, os, sys
depth, out = int(sys.argv[1]), {}
for base in sys.argv[2:]:
    made, error = 0, ""
    try:
        os.makedirs(base, exist_ok=True)
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for _ in range(depth):
                os.mkdir("d", dir_fd=fd)
                nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd, made = nxt, made + 1
        finally:
            os.close(fd)
    except OSError as exc:
        error = errno.errorcode.get(exc.errno, str(exc.errno))
    out[base] = {"depth": made, "error": error}
print(json.dumps(out))
"""

# Plants `name` -> `target` in the socket directory again whenever it is not there, for `seconds`
# (the server removes the marker before a fork and recreates it after).
PLANTER = r"""
import errno, json, os, sys, time
where, name, target, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
report = {"planted": 0, "error": ""}
try:
    os.makedirs(where, exist_ok=True)
except OSError as exc:
    report["error"] = errno.errorcode.get(exc.errno, str(exc.errno))
end = time.monotonic() + seconds
while time.monotonic() < end and not report["error"]:
    path = os.path.join(where, name)
    try:
        if os.path.lexists(path) and not os.path.islink(path):
            os.unlink(path)
        os.symlink(target, path)
        report["planted"] += 1
    except FileExistsError:
        pass
    except OSError as exc:
        report["error"] = errno.errorcode.get(exc.errno, str(exc.errno))
    time.sleep(0.0005)
with open("/tmp/planter.json", "w") as f:
    json.dump(report, f)
"""

ODD_MODES = r"""
import errno, json, os, sys
where = sys.argv[1]
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except OSError as exc:
        out[name] = errno.errorcode.get(exc.errno, str(exc.errno))
attempt("mkdir", lambda: os.makedirs(where, exist_ok=True))
def setuid_file():
    path = os.path.join(where, "suid")
    with open(path, "wb") as f:
        f.write(b"#!/bin/sh\nid\n")
    os.chmod(path, 0o4755)
attempt("setuid_file", setuid_file)
def setgid_dir():
    os.mkdir(os.path.join(where, "sgid"))
    os.chmod(os.path.join(where, "sgid"), 0o2777)
attempt("setgid_dir", setgid_dir)
attempt("chmod_dir", lambda: os.chmod(where, 0o6777))
attempt("chmod_socket", lambda: os.chmod(os.path.join(where, "agent.sock"), 0o4777))
print(json.dumps(out))
"""


def _host_dir(server: LocalServer, sandbox_id: str) -> Path:
    return server.state_dir / "sandboxes" / sandbox_id


def _guest_writable_host_dir(server: LocalServer, sandbox_id: str) -> Path:
    """The host directory an escaped guest could write: the socket dir under gVisor (bound into
    the guest); under bwrap no host dir is bound writable, so the sandbox's own host dir stands in."""
    directory = _host_dir(server, sandbox_id)
    return directory / "s" if GVISOR else directory


def _walk_no_follow(top: Path) -> Iterator[tuple[Path, os.stat_result]]:
    """Every entry under ``top`` (lstat, symlinks not followed), iteratively and by fd, so a deep
    tree cannot break the walk either."""
    todo = [top]
    while todo:
        directory = todo.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            st = entry.stat(follow_symlinks=False)
            yield Path(entry.path), st
            if stat.S_ISDIR(st.st_mode) and len(entry.path) < 3000:
                todo.append(Path(entry.path))


def plant_deep_tree(parent: Path, depth: int, outside: Path) -> None:
    """``depth`` nested directories under ``parent`` (by fd: the path is past PATH_MAX), with a
    symlink at the bottom to ``outside`` (a host directory deletion must never enter), all
    owned by ``parent``'s owner, as what an escaped guest wrote there would be."""
    st = parent.stat()
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.fchown(nxt, st.st_uid, st.st_gid)
            os.close(fd)
            fd = nxt
        os.symlink(str(outside), "outside", dir_fd=fd)
        os.chown("outside", st.st_uid, st.st_gid, dir_fd=fd, follow_symlinks=False)
    finally:
        os.close(fd)


def remove_leftover_tree(path: Path) -> None:
    """The test's own cleanup of a tree a failing wall left: bottom-up by fd, no recursion."""
    if not path.exists():
        return
    fds = [os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)]
    names: list[str] = []
    try:
        while fds:
            sub = None
            for entry in os.scandir(fds[-1]):
                if entry.is_dir(follow_symlinks=False):
                    sub = entry.name
                    break
                os.unlink(entry.name, dir_fd=fds[-1])
            if sub is not None:
                fds.append(os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fds[-1]))
                names.append(sub)
                continue
            os.close(fds.pop())
            if names:
                os.rmdir(names.pop(), dir_fd=fds[-1])
    finally:
        for fd in fds:
            os.close(fd)
    os.rmdir(path)


def _nothing_left(server: LocalServer, sandbox_id: str, timeout: float = 10.0) -> list[str]:
    """What of the sandbox is still in the server's state dir once deletion had ``timeout`` to end
    (trees too big to delete inline are finished in the background, in ``reaped/``)."""
    reaped = server.state_dir / "reaped"
    deadline = time.monotonic() + timeout
    while True:
        left = [str(p) for p in (_host_dir(server, sandbox_id),) if os.path.lexists(p)]
        if reaped.is_dir():
            left += [str(p) for p in reaped.iterdir()]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


# ---- 1. the disk cap ---------------------------------------------------------------------------
def test_a_job_cannot_write_past_its_disk_cap_through_the_socket_directory(
    security_server: LocalServer, sandbox: Any, run_script: Callable[..., dict[str, Any]]
) -> None:
    """Old gVisor: 320 MiB landed on the host disk (root-owned) against the 64 MiB cap."""
    cap = SMALL["disk_mb"] * MiB
    free_before = _free_bytes(security_server.state_dir)
    report = run_script(sandbox, WRITE_FLOOD, GUEST_SOCKET_DIR, cap + 256 * MiB, timeout=120)
    landed = sum(st.st_blocks * 512 for _, st in _walk_no_follow(_host_dir(security_server, sandbox.id)))
    dropped = free_before - _free_bytes(security_server.state_dir)
    assert landed < MiB, f"{landed} bytes of the job's data landed in the sandbox's host dir: {report}"
    assert dropped < cap + FREE_SPACE_SLACK, f"host free space dropped by {dropped // MiB} MiB: {report}"
    if GVISOR:
        # The socket directory is not the job's: it cannot even create a file there.
        assert report == {"written": 0, "error": "EACCES"}, report
    else:
        # bwrap binds no host directory there: the job filled its own tmpfs root up to its cap.
        assert report["error"] == "ENOSPC" and report["written"] <= cap, report


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


# ---- 2. deep trees: delete and restart ---------------------------------------------------------
@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A host directory with a canary file: a symlink at the bottom of each planted tree points here."""
    directory = tmp_path / "outside"
    directory.mkdir()
    (directory / "canary").write_text("still here\n")
    return directory


@pytest.fixture
def tree_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    """A private server (it is crashed and restarted) with the small template, no pool."""
    base = tmp_path_factory.mktemp("deep-tree-templates")
    small = str(write_template(base / "small", **SMALL))
    server = LocalServer(template_dirs=[small], pool_size=0)
    try:
        yield server.start()
    finally:
        server.close()


def _deep_trees(
    server: LocalServer, sb: Any, outside: Path, run_script: Callable[..., dict[str, Any]]
) -> dict[str, Any]:
    """A 3,000-level tree everywhere the job can write (the socket dir under gVisor, its own
    scratch dirs) and one on the host where an escaped guest could write; the job's report."""
    report = run_script(
        sb, DEEP_TREE, DEEP, f"{GUEST_SOCKET_DIR}/tree", "/tmp/tree", "/work/tree", timeout=120
    )
    plant_deep_tree(_guest_writable_host_dir(server, sb.id), DEEP, outside)
    return report


def test_a_deep_tree_is_deleted_and_a_restart_starts(
    tree_server: LocalServer, outside: Path, run_script: Callable[..., dict[str, Any]]
) -> None:
    """Old gVisor: DELETE was a 500 (shutil.rmtree's recursion), the tree stayed, and a server
    restarted on the state dir exited with "Application startup failed"."""
    client = tree_server.client()
    deleted = client.sandboxes.create(template="small")
    crashed = client.sandboxes.create(template="small")
    try:
        reports = [_deep_trees(tree_server, sb, outside, run_script) for sb in (deleted, crashed)]
        started = time.monotonic()
        client.sandboxes.delete(deleted.id)  # a 500 raises
        assert time.monotonic() - started < 10
        assert _nothing_left(tree_server, deleted.id) == []
        # A crash with the other tree still there: the server starts again on that state dir,
        # and the tree goes (in the background: it never holds the start up).
        tree_server.restart()
        assert _nothing_left(tree_server, crashed.id) == []
        assert client.sandboxes.list() == []
        with client.sandboxes.create(template="small") as fresh:
            assert fresh.exec("echo back").stdout == "back\n"
        assert (outside / "canary").read_text() == "still here\n", "deletion followed a symlink"
        for report in reports:
            for scratch in ("/tmp/tree", "/work/tree"):
                assert report[scratch] == {"depth": DEEP, "error": ""}, report
            if GVISOR:  # the socket directory is not the job's to write
                assert report[f"{GUEST_SOCKET_DIR}/tree"] == {"depth": 0, "error": "EACCES"}, report
            else:  # bwrap: that path is in its own tmpfs root, nothing on the host
                assert report[f"{GUEST_SOCKET_DIR}/tree"] == {"depth": DEEP, "error": ""}, report
    finally:
        for sb in (deleted, crashed):
            remove_leftover_tree(_host_dir(tree_server, sb.id))
        remove_leftover_tree(tree_server.state_dir / "reaped")


# ---- 3. fork's resume marker -------------------------------------------------------------------
@pytest.mark.parametrize("target_exists", [False, True], ids=["absent-target", "existing-target"])
def test_fork_never_creates_or_touches_a_file_the_job_names(
    security_client: Any, tmp_path: Path, target_exists: bool
) -> None:
    """Old gVisor: the server touched the job's symlink named like its resume marker on fork():
    a root-owned empty file appeared at the job's host path, or an existing file's mtime moved."""
    target = tmp_path / "victim"
    if target_exists:
        target.write_text("untouched\n")
        os.utime(target, (1_000_000_000, 1_000_000_000))
    sb = security_client.sandboxes.create(template="small")
    children: list[Any] = []
    try:
        sb.filesystem.write("/work/planter.py", PLANTER)
        sb.exec(f"nohup python3 /work/planter.py {GUEST_SOCKET_DIR} resume {target} 3 >/dev/null 2>&1 &")
        time.sleep(0.3)
        children = security_client.sandboxes.fork_tree(sb.id, 1)
        time.sleep(0.3)
        if target_exists:
            assert target.read_text() == "untouched\n"
            assert target.stat().st_mtime == 1_000_000_000, "the server touched the job's target"
        else:
            assert not os.path.lexists(target), "the server created the file the job named"
        # Both sides of the fork keep serving.
        for box in (sb, *children):
            assert box.exec("echo up", timeout_seconds=20).stdout == "up\n"
        waited = sb.exec("for i in $(seq 60); do [ -e /tmp/planter.json ] && break; sleep 0.1; done")
        assert waited.exit_code == 0
        report = json.loads(sb.filesystem.read("/tmp/planter.json"))
        if GVISOR:
            assert report == {"planted": 0, "error": "EACCES"}, report
        else:  # bwrap: the name is in the job's own tmpfs root; no server ever looks there
            assert report["planted"] >= 1 and report["error"] == "", report
    finally:
        for box in (*children, sb):
            box.kill()


# ---- 4. the agent socket ------------------------------------------------------------------------
class Decoy:
    """A host unix listener that records who connects and answers like an agent with a forged result."""

    FORGED = b'\x01\x00\x00\x00\x07FORGED\n\x00\x00\x00\x00\x0f{"exit_code":0}'

    def __init__(self, path: Path) -> None:
        self.path = path
        self.requests: list[bytes] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        os.chmod(path, 0o777)
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1)
                with contextlib.suppress(OSError):
                    self.requests.append(conn.recv(4096))
                    conn.sendall(self.FORGED)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close()


def test_the_server_never_connects_to_a_socket_the_job_names(
    security_client: Any, tmp_path: Path, run_script: Callable[..., dict[str, Any]]
) -> None:
    """Old gVisor: a symlink in place of the agent socket made the server (uid 0) connect to the
    host listener it named and return that listener's bytes as the job's result."""
    decoy = Decoy(tmp_path / "decoy.sock")
    sb = security_client.sandboxes.create(template="small")
    try:
        swap = (
            "import errno, json, os, sys\n"
            f"agent_sock, decoy = {GUEST_SOCKET_DIR + '/agent.sock'!r}, {str(decoy.path)!r}\n"
            "out = {}\n"
            "for step, fn in (('unlink', lambda: os.unlink(agent_sock)),\n"
            "                 ('symlink', lambda: os.symlink(decoy, agent_sock))):\n"
            "    try:\n"
            "        fn(); out[step] = 'ok'\n"
            "    except OSError as exc:\n"
            "        out[step] = errno.errorcode.get(exc.errno, str(exc.errno))\n"
            "print(json.dumps(out))\n"
        )
        report = run_script(sb, swap)
        for _ in range(3):
            result = sb.exec("echo real")
            assert (result.exit_code, result.stdout) == (0, "real\n"), result
        assert sb.filesystem.read("/work/attack.py")
        assert decoy.requests == [], f"the server connected to the job's listener: {decoy.requests[:1]}"
        if GVISOR:
            assert report == {"unlink": "EACCES", "symlink": "EACCES"}, report
        else:  # bwrap: the agent socket is the server's, on the host; the guest has no such name
            assert report == {"unlink": "ENOENT", "symlink": "ENOENT"}, report
    finally:
        sb.kill()
        decoy.close()


def test_the_server_links_only_a_socket_the_sandbox_bound(tmp_path: Path) -> None:
    """What an escaped guest could leave in its socket dir (a symlink to a host listener, a
    listener it does not own, a plain file, a second name for another socket) is never linked
    as the server's agent socket; a socket the sandbox's uid bound is. (Both backends: the
    server-side check itself.)"""
    from pandastack_local.isolation.gvisor.backend import link_agent_socket

    directory = tmp_path / "sandbox"
    sock_dir = directory / "s"
    sock_dir.mkdir(parents=True)
    decoy = socket.socket(socket.AF_UNIX)
    decoy.bind(str(tmp_path / "decoy.sock"))
    root = os.geteuid() == 0  # (the gVisor backend needs a root server; a non-root run checks less)
    owner = 0x60000000 + 4242 if root else os.geteuid()  # the sandbox's uid; the decoy is root's
    planted = sock_dir / "agent.sock"
    try:
        for plant in (
            lambda: planted.symlink_to(tmp_path / "decoy.sock"),
            lambda: planted.write_text("not a socket"),
            # root's listener; then a second name for a socket of the sandbox's uid bound elsewhere
            lambda: os.link(tmp_path / "decoy.sock", planted),
            lambda: (
                os.chown(tmp_path / "decoy.sock", owner, owner),
                os.link(tmp_path / "decoy.sock", planted),
            ),
        ):
            plant()
            assert link_agent_socket(directory, owner) is False
            assert not os.path.lexists(directory / "agent.sock")
            planted.unlink()
        own = socket.socket(socket.AF_UNIX)
        own.bind(str(planted))
        own.listen(1)
        os.chown(planted, owner, owner)
        # Linking an fd's inode (linkat AT_EMPTY_PATH) takes root's CAP_DAC_READ_SEARCH.
        assert link_agent_socket(directory, owner) is root
        if root:
            assert (directory / "agent.sock").stat().st_ino == planted.stat().st_ino
            client = socket.socket(socket.AF_UNIX)
            client.connect(str(directory / "agent.sock"))
            client.close()
            # After a checkpoint the old socket is never linked again (a job that says
            # "listening" before the agent has bound its new one gets nothing linked).
            (directory / "agent.sock").unlink()
            st = planted.stat()
            assert link_agent_socket(directory, owner, (st.st_dev, st.st_ino)) is False
        own.close()
    finally:
        decoy.close()


PIPE_FLOOD = r"""
import errno, json, os, sys, time
# Every descriptor of the sandbox's other processes this job can open for writing (under gVisor
# the agent's, through /proc/1/fd: its pipes to the server among them), flooded for a while.
seconds, targets, out = float(sys.argv[1]), [], {"opened": [], "written": 0}
own = {os.readlink(f"/proc/self/fd/{n}") for n in (0, 1, 2)}  # the exec's own pipes
for pid in (p for p in os.listdir("/proc") if p.isdigit()):
    try:
        if os.getsid(int(pid)) == os.getsid(0):
            continue  # this exec's own session (its output pipe is the exec's reply)
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        continue
    for n in fds:
        try:
            fd = os.open(f"/proc/{pid}/fd/{n}", os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue
        if os.readlink(f"/proc/{pid}/fd/{n}") not in own | {"/dev/null"}:
            targets.append(fd)
            out["opened"].append(f"{pid}/{n}")
end = time.monotonic() + seconds
while time.monotonic() < end and targets:
    for fd in targets:
        try:
            out["written"] += os.write(fd, b"L" * 4096)
        except OSError:
            pass
    time.sleep(0)
print(json.dumps(out))
"""


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_job_writing_into_the_agents_pipes_costs_the_server_nothing(
    security_server: LocalServer,
    security_client: Any,
    sandbox: Any,
    run_script: Callable[..., dict[str, Any]],
) -> None:
    """Under gVisor a job can open the agent's descriptors through /proc/1/fd (the sentry grants
    a same-uid process what Linux refuses for a non-dumpable one), the server's pipes among
    them. The server reads the listening pipe only while it waits for a bind, so a flood fills
    the pipe and stops there. (Before: every byte woke the server's event loop for a link check.)"""
    assert security_server.pid is not None
    spent = {}
    for what, script in (("idle", "import time; time.sleep(3); print('{}')"), ("flood", PIPE_FLOOD)):
        before = _cpu_seconds(security_server.pid)
        report = run_script(sandbox, script, 3)
        spent[what] = _cpu_seconds(security_server.pid) - before
    assert spent["flood"] < spent["idle"] + 0.1, f"server CPU, s: {spent}; the job: {report}"
    assert sandbox.exec("echo up").stdout == "up\n"
    # A fork while the flood goes on: the agent's "listening" after its new bind neither waits
    # for room in the pipe nor gets lost, and both sides keep serving.
    sandbox.exec("nohup python3 /work/attack.py 4 >/dev/null 2>&1 &")
    time.sleep(0.5)
    # A fork checkpoints a sandbox whose job floods on every core it can get: 8 s alone, past the
    # SDK's 30 s default once in a loaded CI run (load 20-40). A hang still fails, at 120 s.
    children = security_server.client(timeout=120).sandboxes.fork_tree(sandbox.id, 1)
    try:
        for box in (sandbox, *children):
            assert box.exec("echo up", timeout_seconds=20).stdout == "up\n"
    finally:
        for child in children:
            child.kill()


# ---- 5. modes ------------------------------------------------------------------------------------
def test_a_job_leaves_no_setuid_file_and_no_odd_mode_on_the_host(
    security_server: LocalServer, sandbox: Any, run_script: Callable[..., dict[str, Any]]
) -> None:
    """Old gVisor: a host file mode 04755 owned by uid 0, and the socket directory 0o46777."""
    report = run_script(sandbox, ODD_MODES, GUEST_SOCKET_DIR)
    directory = _host_dir(security_server, sandbox.id)
    found = list(_walk_no_follow(directory))
    special = [(str(p), oct(st.st_mode)) for p, st in found if st.st_mode & (stat.S_ISUID | stat.S_ISGID)]
    assert special == [], f"setuid/setgid files on the host: {special} ({report})"
    if GVISOR:
        assert report == {
            "mkdir": "ok",  # it exists (exist_ok)
            "setuid_file": "EACCES",
            "setgid_dir": "EACCES",
            "chmod_dir": "EPERM",
            "chmod_socket": "EACCES",
        }, report
        sock_dir = directory / "s"
        st = sock_dir.lstat()
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid != 0, oct(st.st_mode)
        # What the guest made on the host (the agent's socket) is the sandbox's uid's, not root's.
        made = [(str(p), st.st_uid) for p, st in _walk_no_follow(sock_dir)]
        assert made and all(uid != 0 for _, uid in made), made
    else:  # bwrap: every path is in the job's own tmpfs root
        assert report["setuid_file"] == "ok" and report["chmod_dir"] == "ok", report
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700


# ---- 6. the sentry's host uid ---------------------------------------------------------------------
def _host_processes(marker: str) -> list[tuple[int, str, int, str]]:
    """(pid, argv0, host uid, user namespace) of every host process whose command line has ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path("/proc", entry, "cmdline").read_bytes()
            if marker.encode() not in cmdline.replace(b"\0", b" "):
                continue
            status = Path("/proc", entry, "status").read_text()
            userns = os.readlink(f"/proc/{entry}/ns/user")
        except OSError:
            continue
        uid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:")))
        found.append((int(entry), cmdline.split(b"\0")[0].decode(errors="replace"), uid, userns))
    return found


def _not_an_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return True
    return False


def test_the_sandbox_kernel_runs_as_an_unprivileged_host_uid(
    security_server: LocalServer, security_client: Any
) -> None:
    """Old gVisor: the sentry (and the gofer) ran as host uid 0 with six capabilities."""
    root_server = security_server.uid() == 0
    boxes = [security_client.sandboxes.create(template="small") for _ in range(2)]
    try:
        uids = []
        for sb in boxes:
            if GVISOR:
                procs = [p for p in _host_processes(sb.id) if p[1] in ("runsc-sandbox", "runsc-gofer")]
                assert {p[1] for p in procs} == {"runsc-sandbox", "runsc-gofer"}, procs
            else:  # bwrap: the job's own processes are host processes
                job = own_sleep(40 + len(uids))
                sb.exec(f"nohup {job} >/dev/null 2>&1 &")
                time.sleep(0.2)
                procs = _host_processes(job)
                assert procs, "the job's process is not on the host"
            assert all(uid != 0 for _, _, uid, _ in procs), procs
            if root_server:  # a root server maps each sandbox to a uid no account has
                assert all(_not_an_account(uid) for _, _, uid, _ in procs), procs
                server_ns = os.readlink(f"/proc/{security_server.pid}/ns/user")
                assert all(ns != server_ns for *_, ns in procs), procs
            uids.append({uid for _, _, uid, _ in procs})
        if root_server:
            assert uids[0].isdisjoint(uids[1]), f"two sandboxes share a host uid: {uids}"
    finally:
        for sb in boxes:
            sb.kill()
