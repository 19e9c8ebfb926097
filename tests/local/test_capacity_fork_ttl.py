"""Capacity refusals (and the SDK's create retry), fork, TTL reaping, crash and restart."""

from __future__ import annotations

import os
import threading
import time

import pandastack
import pytest

from pandastack_local.testing.procs import own_sleep, pids_matching
from tests.support.server import GVISOR


def test_503_is_retried_by_the_sdk_until_capacity_frees(make_local_server) -> None:
    server = make_local_server(max_sandboxes=1, pool_size=0)
    retries = []
    client = server.client(max_create_retry_seconds=20, on_create_retry=retries.append)
    held = client.sandboxes.create()
    threading.Timer(1.5, lambda: client.sandboxes.delete(held.id)).start()
    started = time.monotonic()
    second = client.sandboxes.create()
    assert time.monotonic() - started >= 1.0
    assert retries and retries[0].status_code == 503 and retries[0].error == "no compute capacity available"
    assert retries[0].retry_after_seconds is not None
    second.kill()


def test_503_surfaces_when_the_budget_runs_out(make_local_server) -> None:
    server = make_local_server(max_sandboxes=1, pool_size=0)
    client = server.client(max_create_retry_seconds=0)
    held = client.sandboxes.create()
    try:
        with pytest.raises(pandastack.ServerError, match="no compute capacity available"):
            client.sandboxes.create()
    finally:
        held.kill()


def test_a_deleted_sandbox_frees_its_place_at_once_and_its_removal_finishes(make_local_server) -> None:
    """DELETE answers before the host removal is done (docs/local-server.md): the place it held is
    free at once (no 503 at max_sandboxes=1, no retry), its id is a 404, and the removal ends."""
    server = make_local_server(max_sandboxes=1, pool_size=0)
    client = server.client(max_create_retry_seconds=0)
    ids = []
    job = own_sleep(77)
    for _ in range(3):
        sb = client.sandboxes.create()
        sb.exec(f"nohup {job} >/dev/null 2>&1 &")
        ids.append(sb.id)
        client.sandboxes.delete(sb.id)
        with pytest.raises(pandastack.NotFoundError):
            client.sandboxes.get(sb.id)
        with pytest.raises(pandastack.NotFoundError):
            sb.exec("true")
    server.wait_for_teardown()
    assert [i for i in ids if (server.state_dir / "sandboxes" / i).exists()] == []
    assert _cgroup_dirs_named(ids) == []
    assert not pids_matching(job)


def _cgroup_dirs_named(names: list[str]) -> list[str]:
    """The cgroup directories named one of ``names``, anywhere under /sys/fs/cgroup. Other suites'
    servers run beside this one and remove their own cgroups mid-walk: a directory that vanishes
    while walked is skipped (``os.walk`` ignores it), never an error."""
    wanted = set(names)
    return [os.path.join(top, d) for top, dirs, _ in os.walk("/sys/fs/cgroup") for d in dirs if d in wanted]


def test_507_memory_budget(make_local_server) -> None:
    server = make_local_server(memory_budget_mb=3000, pool_size=0, admission="limits")
    retries = []
    client = server.client(max_create_retry_seconds=20, on_create_retry=retries.append)
    held = client.sandboxes.create()  # 2048 MB of the 3000 MB budget
    threading.Timer(1.0, lambda: client.sandboxes.delete(held.id)).start()
    second = client.sandboxes.create()
    assert retries and retries[0].status_code == 507
    assert retries[0].error.startswith("insufficient host memory for sandbox")
    no_retry = server.client(max_create_retry_seconds=0)
    with pytest.raises(pandastack.ServerError, match="insufficient host memory"):
        no_retry.sandboxes.create()
    second.kill()


def test_fork_copies_disk_not_processes(ps_client, local_server) -> None:
    parent = ps_client.sandboxes.create(metadata={"role": "parent"})
    children = []
    try:
        parent.filesystem.write("/work/state.json", b'{"warm": true}')
        parent.exec("mkdir -p /opt/data && echo cached > /opt/data/c.txt")
        parent.exec("nohup sleep 5555 >/dev/null 2>&1 &")
        child = parent.fork(metadata={"ignored": "yes"})
        children.append(child)
        assert child.id != parent.id
        fetched = ps_client.sandboxes.get(child.id)
        assert fetched.metadata == {"forked_from": parent.id}
        assert child.filesystem.read("/work/state.json") == b'{"warm": true}'
        assert child.exec("cat /opt/data/c.txt").stdout == "cached\n"
        processes = child.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout
        # bwrap's fork copies the disk; gVisor's copies the memory too (checkpoint + restore).
        assert ("sleep 5555" in processes) is GVISOR
        # Unlike the hosted platform's cold fork, a local child inherits its parent's TTL (issue 12).
        assert child.lifecycle()["ttl_seconds"] == parent.lifecycle()["ttl_seconds"] == 300
        assert child.set_ttl(60)["ttl_seconds"] == 60
        # The copy is independent.
        child.filesystem.write("/work/state.json", b"child")
        assert parent.filesystem.read("/work/state.json") == b'{"warm": true}'
        tree = parent.fork_tree(3)
        children.extend(tree)
        assert len({c.id for c in tree}) == 3
        for c in tree:
            assert c.filesystem.read("/work/state.json") == b'{"warm": true}'
        with pytest.raises(pandastack.BadRequestError):
            parent.fork_tree(17)
    finally:
        for c in children:
            c.kill()
        parent.kill()


def test_ttl_reaps_idle_sandboxes_and_activity_resets_it(make_local_server) -> None:
    server = make_local_server(ttl_scan_interval=0.2, pool_size=0)
    client = server.client()
    idle = client.sandboxes.create(ttl_seconds=1)
    busy = client.sandboxes.create(ttl_seconds=1)
    child = busy.fork()  # inherits ttl 1 and is never used: reaped like ``idle``
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        busy.exec("true")
        time.sleep(0.3)
    ids = {s.id for s in client.sandboxes.list()}
    assert idle.id not in ids and child.id not in ids
    assert busy.id in ids
    server.wait_for_teardown()
    assert not (server.state_dir / "sandboxes" / idle.id).exists()
    busy.kill()


def test_crash_kills_sandboxes_and_restart_reaps_leftovers(make_local_server) -> None:
    server = make_local_server(pool_size=1)
    client = server.client()
    sb = client.sandboxes.create()
    job = own_sleep(66)
    sb.exec(f"nohup {job} >/dev/null 2>&1 &")
    # Under gVisor a job's processes live in the sentry: its host processes are runsc's, named by id.
    probe = sb.id if GVISOR else job
    assert pids_matching(probe)
    old_pid, port = server.pid, server.port
    server.restart()
    assert server.pid != old_pid and server.port == port
    deadline = time.monotonic() + 5
    while pids_matching(probe) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pids_matching(probe), "sandbox survived its server's crash"
    assert not (server.state_dir / "sandboxes" / sb.id).exists()
    assert _cgroup_dirs_named([sb.id]) == []
    assert client.sandboxes.list() == []
    with client.sandboxes.create() as fresh:
        assert fresh.exec("echo back").stdout == "back\n"
