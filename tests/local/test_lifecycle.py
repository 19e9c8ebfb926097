"""The full sandbox lifecycle through the real pandastack SDK over HTTP."""

from __future__ import annotations

import re

import pandastack
import pytest


def test_create_exec_fs_delete(ps_client) -> None:
    sb = ps_client.sandboxes.create(template="base", metadata={"job": "lifecycle"}, ttl_seconds=120)
    try:
        assert re.fullmatch(r"[0-9a-f-]{36}", sb.id)
        assert (sb.template, sb.cpu, sb.memory_mb, sb.status) == ("base", 2, 2048, "running")
        assert sb.metadata == {"job": "lifecycle"}
        assert sb.created_at and sb.created_at.endswith("Z")

        result = sb.exec("echo out; echo err >&2; exit 3")
        assert (result.stdout, result.stderr, result.exit_code) == ("out\n", "err\n", 3)
        # The guest has python3 and coreutils (and Debian's alternatives, e.g. awk), and `timeout`.
        tools = sb.exec("echo a b | awk '{print $2}'; timeout 5 true && echo timeout-ok; python3 -V")
        assert tools.stdout.startswith("b\ntimeout-ok\nPython 3"), tools

        assert sb.filesystem.write("/work/in/data.json", b'{"rows": [1, 2]}') == {
            "path": "/work/in/data.json",
            "bytes": 16,
        }
        assert (
            sb.exec(
                'python3 -c \'import json; print(sum(json.load(open("/work/in/data.json"))["rows"]))\''
            ).stdout
            == "3\n"
        )
        assert sb.filesystem.read("/work/in/data.json") == b'{"rows": [1, 2]}'
        [entry] = sb.filesystem.listdir("/work/in")
        assert (entry.name, entry.is_dir, entry.size) == ("data.json", False, 16)
        assert sb.filesystem.exists("/work/in") and not sb.filesystem.exists("/work/nope")
        info = sb.filesystem.stat("/work/in")
        assert info.is_dir and info.mode.startswith("d")

        got = ps_client.sandboxes.get(sb.id)
        assert got.id == sb.id and got.metadata == {"job": "lifecycle"}
        assert sb.id in [s.id for s in ps_client.sandboxes.list()]
    finally:
        ps_client.sandboxes.delete(sb.id)
    with pytest.raises(pandastack.NotFoundError):
        ps_client.sandboxes.get(sb.id)
    with pytest.raises(pandastack.NotFoundError):
        ps_client.sandboxes.delete(sb.id)


def test_exec_stream_events_in_order(ps_client) -> None:
    with ps_client.sandboxes.create() as sb:
        seen: list[tuple[str, str]] = []
        code = sb.exec_stream(
            "for i in 1 2 3; do echo o$i; echo e$i >&2; sleep 0.05; done; exit 7",
            on_stdout=lambda c: seen.append(("out", c)),
            on_stderr=lambda c: seen.append(("err", c)),
        )
        assert code == 7
        assert "".join(c for k, c in seen if k == "out") == "o1\no2\no3\n"
        assert "".join(c for k, c in seen if k == "err") == "e1\ne2\ne3\n"
        outs = [c for k, c in seen if k == "out"]
        assert outs[0].startswith("o1")
