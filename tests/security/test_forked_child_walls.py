"""A fork child is as walled off as a fresh sandbox (issue 27, item 2): its own namespaces,
cgroup limits, disk copy and host uid; nothing a sibling or the parent does reaches it, and
nothing it does reaches them. The suite's key walls (seccomp, the disk cap, the init's
descriptors, host information) are run here again against a fork child of a warm parent: a
parent with a file and a live process holding a model (50 MB; 16 MB under gVisor).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandastack
import pytest

from pandastack_local import LocalServer
from pandastack_local.isolation.process import host_descendants
from tests.local.test_isolation import CGROUP_ROOT, cgroup_dirs
from tests.security import test_kernel_resources as kernel_resources
from tests.security import test_walls_weak_spots as weak_spots
from tests.support.server import GVISOR

NS_GET_PARENT = 0xB702  # _IO(0xb7, 0x2)
NAMESPACES = ("pid", "mnt", "net", "ipc", "uts", "user", "cgroup")
# The warm parent's model. Under gVisor each child holds a copy, charged to its memory (the small
# template's 256 MB), beside what the walls tests put in its memory-backed /dev/shm.
MODEL_MB = 16 if GVISOR else 50
WARM = f"import time; model = bytearray({MODEL_MB} << 20); time.sleep(3600)"
PROCESSES = "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"


@pytest.fixture
def warm_parent(security_client: Any) -> Iterator[Any]:
    parent = security_client.sandboxes.create(template="small")
    try:
        parent.filesystem.write("/work/warm.txt", "warm")
        parent.filesystem.write("/work/warm.py", WARM)
        parent.exec("nohup python3 /work/warm.py warm-model >/dev/null 2>&1 &")
        yield parent
    finally:
        with contextlib.suppress(pandastack.NotFoundError):
            parent.kill()


@pytest.fixture
def sandbox(warm_parent: Any) -> Iterator[Any]:
    """Overrides conftest's ``sandbox``: a fork child of the warm parent."""
    child = warm_parent.fork()
    try:
        yield child
    finally:
        with contextlib.suppress(pandastack.NotFoundError):
            child.kill()


# The key walls of the suite, against a fork child (their own modules run them on a fresh sandbox).
test_seccomp_in_a_fork_child = weak_spots.test_seccomp_denies_the_dangerous_syscalls
test_disk_cap_in_a_fork_child = weak_spots.test_shm_and_every_tmpfs_count_against_the_disk_cap
test_init_descriptors_in_a_fork_child = kernel_resources.test_the_sandbox_init_gives_no_descriptor_away
test_host_information_in_a_fork_child = (
    kernel_resources.test_host_paths_kernel_command_line_and_boot_id_are_not_shown
)


def _namespaces(sb: Any) -> dict[str, str]:
    out = sb.exec("for n in " + " ".join(NAMESPACES) + "; do readlink /proc/self/ns/$n; done").stdout
    return dict(zip(NAMESPACES, out.split(), strict=True))


def _agent(server: LocalServer, sandbox_id: str) -> int:
    """The host pid of a sandbox's agent (below the bwrap its record names, whose argv names it too)."""
    record = json.loads((server.state_dir / "sandboxes" / sandbox_id / "record.json").read_text())
    for pid in [record["pid"], *host_descendants(record["pid"])]:
        with contextlib.suppress(OSError):
            if (
                Path(f"/proc/{pid}/cmdline")
                .read_bytes()
                .startswith(b"/usr/bin/python3\0-I\0-S\0/.pandastack/agent.py")
            ):
                return pid
    raise AssertionError(f"no agent below {record}")


def _ancestors(pid: int, ns: str) -> list[int]:
    """The namespaces that ``ns`` of host process ``pid`` is nested in, innermost first, up to the
    host's (ioctl NS_GET_PARENT; EPERM past the host's own)."""
    out: list[int] = []
    fd = os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY)
    try:
        while True:
            try:
                parent = fcntl.ioctl(fd, NS_GET_PARENT)
            except PermissionError:
                return out
            os.close(fd)
            fd = parent
            out.append(os.fstat(fd).st_ino)
    finally:
        os.close(fd)


LIMIT_FILES = (
    "memory.limit_in_bytes",
    "memory.memsw.limit_in_bytes",
    "memory.max",
    "pids.max",
    "cpu.cfs_quota_us",
    "cpu.max",
)


def _limits(sandbox_id: str) -> dict[str, str]:
    """The limits of the sandbox's own cgroups (its id names them), by controller."""
    out = {}
    for d in cgroup_dirs(sandbox_id):
        for f in LIMIT_FILES:
            with contextlib.suppress(OSError):
                out[f"{d.relative_to(CGROUP_ROOT).parts[0]}/{f}"] = (d / f).read_text().strip()
    return out


def test_fork_children_are_siblings_with_their_own_namespaces_uid_and_cgroup(
    security_server: LocalServer, warm_parent: Any
) -> None:
    a, b = warm_parent.fork(), warm_parent.fork()
    try:
        boxes = {"parent": warm_parent, "a": a, "b": b}
        if not GVISOR:  # (under gVisor each sandbox has a kernel of its own: there are no host namespaces)
            seen = {name: _namespaces(sb) for name, sb in boxes.items()}
            host = {n: str(Path(f"/proc/self/ns/{n}").readlink()) for n in NAMESPACES}
            for ns in NAMESPACES:
                values = [seen[name][ns] for name in boxes] + [host[ns]]
                assert len(set(values)) == len(values), f"{ns} namespace shared: {values}"
            agents = {name: _agent(security_server, sb.id) for name, sb in boxes.items()}
            own = {
                name: {ns: os.stat(f"/proc/{pid}/ns/{ns}").st_ino for ns in ("pid", "user")}
                for name, pid in agents.items()
            }
            for name, pid in agents.items():
                # Not nested in the parent's or a sibling's namespaces (which would let those see and
                # ptrace it): its pid namespace is the host's child, its user namespaces are its own.
                assert _ancestors(pid, "pid") == [os.stat("/proc/self/ns/pid").st_ino], name
                for other in set(boxes) - {name}:
                    for ns in ("pid", "user"):
                        assert own[other][ns] not in _ancestors(pid, ns), (
                            f"{name} nested in {other}'s {ns} ns"
                        )
            if security_server.uid() == 0:
                uids = {
                    name: re.search(r"^Uid:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M)
                    for name, pid in agents.items()
                }
                assert len({m.group(1) for m in uids.values() if m}) == 3, uids
        fresh = security_server.client().sandboxes.create(template="small")
        try:
            want = _limits(fresh.id)
        finally:
            fresh.kill()
        if security_server.uid() == 0:  # a non-root server has no cgroups to give (its own limits only)
            assert {k.split("/")[0] for k in want} >= {"memory", "pids"}, want
        for name, sb in boxes.items():
            assert _limits(sb.id) == want, f"{name}'s cgroup limits are not a fresh sandbox's"
    finally:
        a.kill()
        b.kill()


def test_a_fork_childs_files_processes_and_memory_stay_its_own(warm_parent: Any) -> None:
    a, b = warm_parent.fork(), warm_parent.fork()
    try:
        for child in (a, b):  # each starts with the parent's disk
            assert child.filesystem.read("/work/warm.txt") == b"warm"
        a.filesystem.write("/work/warm.txt", "changed by a")
        a.exec("echo a > /dev/shm/a; echo a > /tmp/a")
        a.filesystem.write(
            "/work/serve.py",
            "import socket, time\ns = socket.socket()\n"
            "s.bind(('127.0.0.1', 8765)); s.listen(1); time.sleep(3600)  # a-listener\n",
        )
        a.exec("nohup python3 /work/serve.py a-listener >/dev/null 2>&1 &")
        probe = (
            "import socket, time\nfor _ in range(50):\n    s = socket.socket()\n"
            "    try:\n        s.connect(('127.0.0.1', 8765)); print('connected'); break\n"
            "    except OSError:\n        time.sleep(0.05)\nelse:\n    print('refused')\n"
        )
        for sb in (a, b, warm_parent):
            sb.filesystem.write("/work/probe.py", probe)
        assert a.exec("python3 /work/probe.py").stdout.strip() == "connected"  # the listener is up
        # A 400 MB allocation in a fork child is charged to its own cgroup: it dies (the small
        # template's 256 MB), and the parent's model process lives on.
        try:
            hog = a.exec("python3 -c 'x = bytearray(400 << 20); print(len(x))'")
            assert hog.exit_code != 0, hog
        except pandastack.ServerError as exc:  # gVisor: a sandbox past its memory is lost whole
            assert GVISOR and "not running" in str(exc), exc
        for other in (b, warm_parent):
            assert other.filesystem.read("/work/warm.txt") == b"warm"
            assert other.exec("cat /dev/shm/a /tmp/a 2>/dev/null; true").stdout == ""
            assert "a-listener" not in other.exec(PROCESSES).stdout
            assert other.exec("python3 /work/probe.py").stdout.strip() == "refused"
        assert "warm-model" in warm_parent.exec(PROCESSES).stdout, "a child's work touched the parent"
        # Its writes are its own; the parent's live process is the parent's alone under bwrap
        # (a disk fork: memory_copied false), a copy of it in each child under gVisor.
        assert ("warm-model" in b.exec(PROCESSES).stdout) is GVISOR
    finally:
        a.kill()
        b.kill()
