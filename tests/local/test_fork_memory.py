"""A fork says whether it copied the parent's memory, never silently (issue 27, item 2).

Under bwrap a fork copies the disk only (``isolation/bwrap/memory_fork.py`` says why): the
fork's response and each child say ``memory_copied: false`` and why, and a fork that requires
memory is refused before any child is made. Under gVisor the same requests see a memory fork.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.support.server import GVISOR

PROCESSES = "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"


def _ids(http: httpx.Client) -> set[str]:
    return {sb["id"] for sb in http.get("/v1/sandboxes").json()}


def test_the_fork_and_each_child_say_whether_memory_was_copied(
    local_http: httpx.Client, ps_client: Any
) -> None:
    parent = ps_client.sandboxes.create()
    made: list[str] = []
    try:
        parent.exec("nohup sleep 7777 >/dev/null 2>&1 &")
        reply = local_http.post(f"/v1/sandboxes/{parent.id}/fork", json={})
        assert reply.status_code == 201, reply.text
        body = reply.json()
        made += body["children"]
        tree = local_http.post(f"/v1/sandboxes/{parent.id}/fork-tree", json={"count": 2})
        assert tree.status_code == 201, tree.text
        made += [c["id"] for c in tree.json()["children"]]
        assert body["memory_copied"] is tree.json()["memory_copied"] is GVISOR
        assert [c["memory_copied"] for c in tree.json()["children"]] == [GVISOR, GVISOR]
        for child_id in made:
            assert local_http.get(f"/v1/sandboxes/{child_id}").json()["memory_copied"] is GVISOR
            # The flag tells the truth: the parent's live process is in the child exactly when it says so.
            running = ps_client.sandboxes.get(child_id).exec(PROCESSES).stdout
            assert ("sleep 7777" in running) is GVISOR, running
        assert local_http.get(f"/v1/sandboxes/{parent.id}").json()["memory_copied"] is None  # no fork child
        if not GVISOR:
            for why in (body["why"], tree.json()["why"]):
                assert "disk only, not its memory or processes" in why and "Memory fork under bwrap" in why
            logs = local_http.get(f"/v1/sandboxes/{made[0]}/logs").text
            assert "memory NOT copied" in logs, logs
        else:
            assert "why" not in body
    finally:
        for child_id in made:
            local_http.delete(f"/v1/sandboxes/{child_id}")
        parent.kill()


def test_require_memory_refuses_a_disk_only_fork_before_any_child_is_made(
    local_http: httpx.Client, ps_client: Any
) -> None:
    parent = ps_client.sandboxes.create()
    try:
        before = _ids(local_http)
        for route, body in (("fork", {}), ("fork-tree", {"count": 2})):
            reply = local_http.post(
                f"/v1/sandboxes/{parent.id}/{route}", json={**body, "require_memory": True}
            )
            if GVISOR:  # a memory fork: require_memory is met
                assert reply.status_code == 201 and reply.json()["memory_copied"] is True, reply.text
                children = reply.json()["children"]
                for child in children:
                    local_http.delete(f"/v1/sandboxes/{child if isinstance(child, str) else child['id']}")
                continue
            assert reply.status_code == 409, reply.text
            error = reply.json()["error"]
            assert error.startswith("fork refused: require_memory:"), error
            assert "--isolation gvisor" in error and "fork without require_memory" in error, error
            assert _ids(local_http) == before, "a refused fork left a child"
        bad = local_http.post(f"/v1/sandboxes/{parent.id}/fork", json={"require_memory": "yes"})
        assert bad.status_code == 400 and "require_memory must be a boolean" in bad.json()["error"], bad.text
        assert _ids(local_http) == before
        # Without it the disk-only fork still works.
        ok = local_http.post(f"/v1/sandboxes/{parent.id}/fork", json={"require_memory": False})
        assert ok.status_code == 201, ok.text
        local_http.delete(f"/v1/sandboxes/{ok.json()['children'][0]}")
    finally:
        parent.kill()


def test_a_code_contexts_state_is_in_each_child_exactly_when_memory_was_copied(
    local_http: httpx.Client, ps_client: Any
) -> None:
    """A context holding a 50 MB object and a counter: under gVisor each child's copy of it counts
    on its own from the parent's value; under bwrap no child has it, as memory_copied says."""
    import pandastack
    from pandastack.sandbox import CodeContext

    parent = ps_client.sandboxes.create()
    children: list[Any] = []
    try:
        ctx = parent.create_code_context()
        assert (
            ctx.run_code("model = bytearray(50 << 20); counter = 41\nprint(len(model))").stdout
            == "52428800\n"
        )
        children = parent.fork_tree(2)
        step = "counter += 1\nprint(len(model), counter)"
        for child in children:
            assert local_http.get(f"/v1/sandboxes/{child.id}").json()["memory_copied"] is GVISOR
            copy = CodeContext(child, ctx.id)
            if GVISOR:
                assert copy.run_code(step).stdout == "52428800 42\n"
                assert copy.run_code(step).stdout == "52428800 43\n"  # its own copy counts on
            else:
                with pytest.raises(pandastack.NotFoundError, match="not found in sandbox"):
                    copy.run_code(step)
        assert ctx.run_code(step).stdout == "52428800 42\n", "a child's work reached the parent's context"
    finally:
        for child in children:
            child.kill()
        parent.kill()


def test_concurrent_forks_of_one_parent_never_lose_it(local_http: httpx.Client, ps_client: Any) -> None:
    # Under gVisor three forks at once quiesced one agent three times: a refused one's resume
    # reopened the listener under another's checkpoint and the parent was lost (500, killed).
    parent = ps_client.sandboxes.create()
    made: list[str] = []
    try:
        with ThreadPoolExecutor(3) as pool:
            replies = list(
                pool.map(lambda _: local_http.post(f"/v1/sandboxes/{parent.id}/fork", json={}), range(3))
            )
        for reply in replies:
            assert reply.status_code in (201, 409), reply.text
            if reply.status_code == 201:
                made += reply.json()["children"]
            else:
                assert "another fork of it is under way" in reply.json()["error"], reply.text
        assert made, [r.text for r in replies]
        assert parent.exec("echo alive").stdout == "alive\n"
    finally:
        for child_id in made:
            local_http.delete(f"/v1/sandboxes/{child_id}")
        parent.kill()
